"""A decoder layer's block rows in two C calls (kernels/layer_ops.py + csrc/layer_ops.c)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import runnable_isa

from kvpark.kernels import layer_ops
from kvpark.kernels import quant_linear as ql
from kvpark.kernels.cpu_features import Isa, detect
from kvpark.pod.model.layers import DecoderLayer, apply_rope, rope_cos_sin
from kvpark.pod.model.linear import BlockRows
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.loader import load_model_files

pytestmark = pytest.mark.skipif(not layer_ops.is_available(), reason="no working C compiler")
ROWS = 7  # across the linears' row tiles of 4


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return load_model_files("builtin://smollm2-135m")


@pytest.fixture(scope="module")
def layer(smollm2):
    """Layer 3 of SmolLM2-135M with its GGUF blocks (Q4_1)."""
    return DecoderLayer(smollm2.config, smollm2.weights, "model.layers.3",
                        quantized=smollm2.quantized)


def fused_for(layer: DecoderLayer, isa) -> layer_ops.FusedLayer:
    c = layer.config
    return layer_ops.FusedLayer(
        hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, eps=c.rms_norm_eps, input_norm=layer.input_norm,
        post_norm=layer.post_attn_norm, qkv=layer.qkv.blocks, o=layer.o.blocks,
        gate_up=layer.gate_up.blocks, down=layer.down.blocks, isa=isa)


def cos_sin(config, rows: int):
    positions = torch.tensor([0, 5, 17, 250, 999, 1000, 4095][:rows])
    return rope_cos_sin(positions, config.head_dim, config.rope_theta, torch.float32)


def test_rms_norm_is_close_to_torch_and_per_row(isa):
    x, w = randn(ROWS, 576) * 3, randn(576, seed=1)
    y = layer_ops.rms_norm(x, w, 1e-5, isa)
    assert rel(y, F.rms_norm(x, (576,), w, 1e-5)) < 1e-6
    for r in range(ROWS):
        assert same_bits(layer_ops.rms_norm(x[r : r + 1], w, 1e-5, isa), y[r : r + 1])
    odd = randn(3, 100, seed=2)  # a length that is no multiple of the vector width
    assert rel(layer_ops.rms_norm(odd, w[:100], 1e-6, isa),
               F.rms_norm(odd, (100,), w[:100], 1e-6)) < 1e-6


def test_rope_is_close_to_apply_rope_and_per_row(smollm2, isa):
    c = smollm2.config
    cos, sin = cos_sin(c, ROWS)
    x = randn(ROWS, c.num_heads + c.num_kv_heads, c.head_dim)
    y = layer_ops.rope(x, cos, sin, isa)
    assert rel(y, apply_rope(x, cos, sin)) < 1e-6
    for r in range(ROWS):
        assert same_bits(layer_ops.rope(x[r : r + 1], cos[r : r + 1], sin[r : r + 1], isa),
                         y[r : r + 1])


def test_silu_mul_is_close_to_torch_and_per_row(isa):
    gu = randn(ROWS, 2 * 1536) * 4
    y = layer_ops.silu_mul(gu, isa)
    gate, up = gu.chunk(2, dim=-1)
    assert rel(y, F.silu(gate) * up) < 1e-6
    for r in range(ROWS):
        assert same_bits(layer_ops.silu_mul(gu[r : r + 1], isa), y[r : r + 1])


@pytest.mark.parametrize("rows", [1, 15, 16, 31, 32, 33, 100, 600])
def test_the_row_ops_split_rows_between_threads_without_changing_a_bit(smollm2, rows):
    c = smollm2.config
    x, w = randn(rows, 576, seed=3) * 3, randn(576, seed=4)
    gu = randn(rows, 2 * 1536, seed=5) * 4
    qk = randn(rows, c.num_heads + c.num_kv_heads, c.head_dim, seed=6)
    positions = torch.arange(rows) * 7
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, torch.float32)
    cos, sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
    one = (layer_ops.rms_norm(x, w, 1e-5, num_threads=1), layer_ops.silu_mul(gu, num_threads=1),
           layer_ops.rope(qk, cos, sin, num_threads=1))
    for threads in (2, 3):
        split = (layer_ops.rms_norm(x, w, 1e-5, num_threads=threads),
                 layer_ops.silu_mul(gu, num_threads=threads),
                 layer_ops.rope(qk, cos, sin, num_threads=threads))
        assert all(same_bits(a, b) for a, b in zip(one, split)), threads
    # every row as computed alone (the split puts rows 8 and more apart on other threads)
    for r in {0, rows // 2, rows - 1}:
        assert same_bits(layer_ops.silu_mul(gu[r:r + 1], num_threads=1), one[1][r:r + 1])
        assert same_bits(layer_ops.rms_norm(x[r:r + 1], w, 1e-5, num_threads=1), one[0][r:r + 1])


def test_silu_gives_each_value_the_same_bits_in_a_vector_lane_in_the_tail_and_on_every_build():
    """exp by one polynomial in the same operations everywhere: a value's SiLU does not depend on
    where it sits in a row (vector lanes, the scalar tail) nor on the build; extremes stay
    finite (x large: silu(x) = x; x very negative: -0 or a tiny negative)."""
    values = torch.cat([randn(61, seed=4) * 6, torch.tensor([0.0, -0.0, 1e-30, 100.0, -100.0,
                                                             88.5, -88.5, 3e38, -3e38])])
    n = values.numel()
    builds = [isa for isa in Isa if isa in detect().isas]
    per_build = []
    for isa in builds:
        runnable_isa(isa)
        at_start = layer_ops.silu_mul(torch.cat([values, torch.ones(n)])[None], isa)[0]
        for shift in (1, 7, 16, 17):  # the same values further along the row
            row = torch.cat([torch.zeros(shift), values, torch.ones(shift + n)])[None]
            assert same_bits(layer_ops.silu_mul(row, isa)[0, shift:shift + n], at_start)
        per_build.append(at_start)
    for other in per_build[1:]:
        assert same_bits(other, per_build[0])
    y = per_build[0]
    assert torch.isfinite(y).all() and torch.equal(y[[-6, -4, -2]], values[[-6, -4, -2]])
    assert (y[[-5, -3, -1]] <= 0).all() and (y[[-5, -3, -1]] > -1e-30).all()


def test_dense_rows_take_the_c_ops(layer):
    """Prompt rows on the CPU: norms, RoPE and SiLU in the C ops (one pass each), the linears
    dense; the layer's torch-free steps rebuilt by hand give the same bits."""
    c = layer.config
    x = randn(ROWS, c.hidden_size, seed=6)
    cos, sin = cos_sin(c, ROWS)
    dense = BlockRows.all_dense(ROWS)
    q, k, v = layer.attention_inputs(x, cos, sin, dense)
    heads = c.num_heads + c.num_kv_heads
    qkv = layer.qkv(layer_ops.rms_norm(x, layer.input_norm, c.rms_norm_eps), dense)
    qk = layer_ops.rope(qkv[:, : heads * c.head_dim].view(ROWS, heads, c.head_dim), cos, sin)
    assert same_bits(q, qk[:, : c.num_heads]) and same_bits(k, qk[:, c.num_heads :])
    assert same_bits(v, qkv[:, heads * c.head_dim :].view(ROWS, c.num_kv_heads, c.head_dim))
    attn = randn(ROWS, c.num_heads * c.head_dim, seed=7)
    out = layer.mlp_residual(x, attn, dense)
    h = x + layer.o(attn, dense)
    gate_up = layer.gate_up(layer_ops.rms_norm(h, layer.post_attn_norm, c.rms_norm_eps), dense)
    assert same_bits(out, h + layer.down(layer_ops.silu_mul(gate_up), dense))


def torch_attention_inputs(layer, x, cos, sin):
    """The same steps in torch ops over the same blocks (the unfused block-row path)."""
    c = layer.config
    qkv = ql.quant_linear(F.rms_norm(x, (c.hidden_size,), layer.input_norm, c.rms_norm_eps),
                          layer.qkv.blocks)
    heads = c.num_heads + c.num_kv_heads
    qk = apply_rope(qkv[:, : heads * c.head_dim].view(x.shape[0], heads, c.head_dim), cos, sin)
    v = qkv[:, heads * c.head_dim :].view(x.shape[0], c.num_kv_heads, c.head_dim)
    return torch.cat([qk, v], dim=1)


def torch_mlp_residual(layer, x, attn):
    c = layer.config
    x = x + ql.quant_linear(attn, layer.o.blocks)
    h = F.rms_norm(x, (c.hidden_size,), layer.post_attn_norm, c.rms_norm_eps)
    gate, up = ql.quant_linear(h, layer.gate_up.blocks).chunk(2, dim=-1)
    return x + ql.quant_linear(F.silu(gate) * up, layer.down.blocks)


def test_attention_inputs_match_torch_per_row_and_per_thread_count(layer, isa):
    c = layer.config
    fused = fused_for(layer, isa)
    x = randn(ROWS, c.hidden_size, seed=3)
    cos, sin = cos_sin(c, ROWS)
    out = fused.attention_inputs(x, cos, sin, num_threads=1)
    assert out.shape == (ROWS, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
    assert rel(out, torch_attention_inputs(layer, x, cos, sin)) < 1e-5
    for r in range(ROWS):
        alone = fused.attention_inputs(x[r : r + 1], cos[r : r + 1], sin[r : r + 1], 1)
        assert same_bits(alone, out[r : r + 1]), f"row {r} changed with its neighbours"
    for threads in (2, 3):
        assert same_bits(fused.attention_inputs(x, cos, sin, threads), out)


def test_mlp_residual_matches_torch_per_row_and_per_thread_count(layer, isa):
    c = layer.config
    fused = fused_for(layer, isa)
    x = randn(ROWS, c.hidden_size, seed=4)
    attn = randn(ROWS, c.num_heads, c.head_dim, seed=5)
    expected = torch_mlp_residual(layer, x, attn.view(ROWS, -1))
    out = fused.mlp_residual(x.clone(), attn, num_threads=1)
    assert rel(out, expected) < 1e-5
    for r in range(ROWS):
        alone = fused.mlp_residual(x[r : r + 1].clone(), attn[r : r + 1], 1)
        assert same_bits(alone, out[r : r + 1]), f"row {r} changed with its neighbours"
    for threads in (2, 3):
        assert same_bits(fused.mlp_residual(x.clone(), attn, threads), out)
    strided = torch.cat([attn.view(ROWS, -1), attn.view(ROWS, -1)], dim=1)[:, : attn[0].numel()]
    assert same_bits(fused.mlp_residual(x.clone(), strided, 1), out)  # rows with a stride


def test_the_model_fuses_block_layers_only(smollm2, layer):
    assert layer.fused is not None
    assert LlamaModel(smollm2.config, smollm2.weights).layers[0].fused is None  # no blocks
    # q/k norms (Qwen3) or an attention bias (Qwen2) keep the torch path for the whole layer
    qk_config = dataclasses.replace(smollm2.config, qk_norm=True)
    attn = "model.layers.3.self_attn"
    weights = {**smollm2.weights, f"{attn}.q_norm.weight": torch.ones(smollm2.config.head_dim),
               f"{attn}.k_norm.weight": torch.ones(smollm2.config.head_dim)}
    assert DecoderLayer(qk_config, weights, "model.layers.3",
                        quantized=smollm2.quantized).fused is None
    bias_config = dataclasses.replace(smollm2.config, attention_bias=True)
    c = smollm2.config
    sizes = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
    weights = {**smollm2.weights, **{f"{attn}.{p}_proj.bias": torch.zeros(n * c.head_dim)
                                     for p, n in sizes.items()}}
    assert DecoderLayer(bias_config, weights, "model.layers.3",
                        quantized=smollm2.quantized).fused is None


def test_a_wrong_scratch_or_shape_is_refused(layer):
    fused = fused_for(layer, None)
    x = randn(2, layer.config.hidden_size)
    with pytest.raises(AssertionError):
        fused.attention_inputs(x.double(), *cos_sin(layer.config, 2))
    status = fused._lib.kvpark_layer_post(fused._ref, x.data_ptr(), x.stride(0), 2,
                                          x.data_ptr(), x.stride(0), x.data_ptr(), 8, 1)
    assert status == 3  # scratch too small: refused before anything is written


def decode_step(model: LlamaModel, contexts: list[int], use_stack: bool,
                kv_dtype: torch.dtype = torch.float32):
    """One decode row per context over a pool of random K/V (scattered pages): the hidden
    states and the caches after the step, through `FusedStack` or the Python layer loop."""
    from kvpark.kernels.attention import StepLayout
    from kvpark.kernels.cpu_paged import CpuPagedAttention
    from kvpark.pod.memory.kv_pool import KVPool
    from kvpark.pod.model.linear import BlockRows

    c, ps = model.config, 16
    pool = KVPool(c.num_layers, 64, ps, c.num_kv_heads, c.head_dim, dtype=kv_dtype)
    generator = torch.Generator().manual_seed(7)
    for cache in pool.caches:
        cache.normal_(generator=generator)
    free = torch.randperm(64, generator=generator).tolist()
    tables = [[free.pop() for _ in range(n // ps + 1)] for n in contexts]
    backend = CpuPagedAttention()
    backend.plan(StepLayout(tables, [n + 1 for n in contexts], [1] * len(contexts), ps))
    ids = torch.randint(0, c.vocab_size, (len(contexts),), generator=generator)
    stack, model.stack = model.stack, (model.stack if use_stack else None)
    rows = BlockRows.from_mask([True] * len(contexts))
    try:
        assert model.can_stack(rows, backend, pool.caches) == use_stack
        hidden = model(ids, torch.tensor(contexts), backend, pool.caches, rows)
    finally:
        model.stack = stack
    return hidden, pool.caches


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_all_layers_in_one_call_give_the_layer_loops_bits(smollm2, kv_dtype):
    """`FusedStack` makes the loop's C calls in its order: the same hidden states and K/V, bit
    for bit, one row or several, short and long contexts, a float32 or a bf16 pool."""
    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    assert model.stack is not None
    for contexts in ([40], [5, 77, 130], [300, 0]):
        stacked, stacked_kv = decode_step(model, contexts, True, kv_dtype)
        looped, looped_kv = decode_step(model, contexts, False, kv_dtype)
        assert same_bits(stacked, looped)
        assert all(same_bits(a, b) and a.dtype == kv_dtype
                   for a, b in zip(stacked_kv, looped_kv, strict=True))
    assert LlamaModel(smollm2.config, smollm2.weights).stack is None  # no blocks, no stack
    model.drop_blocks()
    assert model.stack is None


def test_rows_of_one_kind_in_one_run_are_views_with_the_gathers_bits(smollm2):
    """A step's decode rows come first, so each kind of row is usually one run: taken as a view
    and put back as one copy, with the bits of gathering them (rows of a recompute replay, where
    the kinds interleave, still gather)."""
    from kvpark.kernels.attention import StepLayout
    from kvpark.kernels.cpu_paged import CpuPagedAttention
    from kvpark.pod.memory.kv_pool import KVPool

    x = torch.arange(12.0).view(6, 2)
    runs = BlockRows.from_mask([True, True, False, False, False, False])
    assert (runs.blocks_run, runs.dense_run) == ((0, 2), (2, 6))
    assert runs.take(x, True).data_ptr() == x[2].data_ptr()  # a view, no gather
    mixed = BlockRows.from_mask([False, True, False, True, True, False])
    assert (mixed.blocks_run, mixed.dense_run) == (None, None)
    assert torch.equal(mixed.take(x, False), x[[1, 3, 4]])
    out = torch.zeros(6, 2)
    for rows in (runs, mixed):
        rows.put(out, True, rows.take(x, True) + 1)
        rows.put(out, False, rows.take(x, False) - 1)
        assert torch.equal(out[rows.dense], x[rows.dense] + 1)
        assert torch.equal(out[rows.blocks], x[rows.blocks] - 1)

    model = LlamaModel(smollm2.config, smollm2.weights, quantized=smollm2.quantized)
    c, ps = model.config, 16
    kv_lens, q_lens = [41, 78, 20], [1, 1, 20]  # two decode rows, then a prompt chunk

    def step(rows: BlockRows) -> torch.Tensor:
        pool = KVPool(c.num_layers, 16, ps, c.num_kv_heads, c.head_dim)
        for cache in pool.caches:
            cache.normal_(generator=torch.Generator().manual_seed(3))
        backend = CpuPagedAttention()
        backend.plan(StepLayout([[0, 1, 2], [3, 4, 5, 6, 7], [8, 9]], kv_lens, q_lens, ps))
        ids = torch.arange(22) * 7
        positions = torch.tensor([40, 77, *range(20)])
        return model(ids, positions, backend, pool.caches, rows)

    viewed = BlockRows.from_mask([True, True] + [False] * 20)
    assert viewed.blocks_run == (0, 2)
    gathered = dataclasses.replace(viewed, blocks_run=None, dense_run=None)
    assert same_bits(step(viewed), step(gathered))
