"""A bf16 KV pool on the CPU (`--cache-type-k/v bf16`): the C kernels read each bf16 value as
the float32 it is the top half of, so attention over a bf16 pool is float32 attention over the
pool's values (its row invariance: test_cpu_paged.py); the C append rounds as torch rounds; AMX
prompt rows, which round K and V to bf16 anyway, do not change a bit; the fused decode stack
gives the layer loop's bits (test_layer_ops.py)."""

import pytest
import torch
from test_amx_attention import needs_amx, tables
from test_torch_paged import relative_error

from kvpark.kernels import cpu_paged
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.kernels.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.skipif(not cpu_paged.is_available(),
                                reason="no working C compiler for the CPU kernel")

PS = 16


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def attend(backend, q: torch.Tensor, cache: torch.Tensor, layout: StepLayout) -> torch.Tensor:
    backend.plan(layout)
    return backend.attend(q, cache)


def random_pool(num_pages: int, kv_heads: int, head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, PS, kv_heads, head_dim, generator=g).bfloat16()


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128), (4, 2, 24)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_pool_gives_float32_attention_over_its_values(isa, hq, hkv, d, threads,
                                                              monkeypatch):
    """Decode rows and prompt rows (chunk edges at 256 and 512 inside them), several sequences
    in one step: float32 attention over the pool's values, products exact (64 and 128 read by
    pairs, whose lane sums are their own; 24 widened a row at a time: the float32 path's bytes).
    """
    kv_lens, q_lens = [1, 300, 513, 40], [1, 1, 20, 40]
    pool = random_pool(80, hkv, d, seed=hq + d)
    q = torch.randn(sum(q_lens), hq, d, generator=torch.Generator().manual_seed(5))
    layout = StepLayout(tables(kv_lens, 80), kv_lens, q_lens, PS)
    backend = CpuPagedAttention(isa=isa, num_threads=threads)
    with monkeypatch.context() as m:  # the C kernel, not the reference it falls back to
        m.setattr(TorchPagedAttention, "attend", None)
        from_bf16 = attend(backend, q, pool, layout)
    widened = attend(backend, q, pool.float(), layout)
    if d % 32:
        assert same_bits(from_bf16, widened)
    assert relative_error(from_bf16, widened) < 1e-6
    assert relative_error(from_bf16, attend(TorchPagedAttention(), q, pool, layout)) < 1e-5


def test_the_append_rounds_as_torch_rounds(isa, monkeypatch):
    """The C append into a bf16 pool leaves the bytes of torch's float32 -> bf16 conversion
    (nearest even, ties included, infinities, rows of k and v strided as views of qkv)."""
    hq, hkv, d = 9, 3, 64
    layout = StepLayout([[5, 2], [7], [0, 3, 4]], [20, 1, 40], [20, 1, 3], PS)
    qkv = torch.randn(24, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(3))
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), float("inf"), 3e38])
    qkv[0, hq * d:hq * d + 5] = ties  # halfway cases round to even; 3e38 stays finite
    k = qkv[:, hq * d:(hq + hkv) * d].view(24, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(24, hkv, d)
    pools = []
    for backend in (CpuPagedAttention(isa=isa), TorchPagedAttention()):
        pool = torch.zeros(8, 2, PS, hkv, d, dtype=torch.bfloat16)
        backend.plan(layout)
        with monkeypatch.context() as m:
            if isinstance(backend, CpuPagedAttention):  # the C call, not the reference's
                m.setattr(TorchPagedAttention, "append_kv", None)
            backend.append_kv(pool, k, v)
        pools.append(pool)
    assert torch.equal(pools[0].view(torch.int16), pools[1].view(torch.int16))
    assert pools[0].float().abs().sum() > 0


@needs_amx
def test_amx_prompt_rows_read_a_bf16_pool_with_the_same_bits():
    """AMX prompt rows round K and V to bf16 on the way into their tiles: from a bf16 pool
    they copy them, from a float32 pool they round them, the same bits either way (the rows
    after the prompt take paged_attention.c)."""
    kv_lens, q_lens, prompt = [300, 33, 513], [300, 17, 21], [300, 16, 20]
    pool32 = torch.randn(80, 2, PS, 3, 64, generator=torch.Generator().manual_seed(9))
    q = torch.randn(sum(q_lens), 9, 64, generator=torch.Generator().manual_seed(2))
    layout = StepLayout(tables(kv_lens, 80), kv_lens, q_lens, PS, prompt_rows=prompt)
    backend = CpuPagedAttention(amx_prompt_rows=True)
    from_bf16 = attend(backend, q, pool32.bfloat16(), layout)
    from_fp32 = attend(backend, q, pool32, layout)
    prompt_rows = torch.tensor([r for r in range(sum(q_lens)) if r not in (316, 337)])
    assert same_bits(from_bf16[prompt_rows], from_fp32[prompt_rows])
    assert not same_bits(from_bf16, from_fp32)  # the generated rows read other values
