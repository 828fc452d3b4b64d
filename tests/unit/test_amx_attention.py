"""Prompt rows' attention on AMX bf16 tiles (csrc/amx_attention.c through CpuPagedAttention):
a prompt row's bits do not depend on the rows beside it, on how its prompt was chunked, on the
sequences in its step or on the thread count, at 1..600 rows and several offsets; rows past the
prompt keep the float32 kernel's bits; the result is attention over bf16-rounded q, k, P and v
to bf16 accuracy; what lies in a page past a sequence's tokens is never read. Runs where the
CPU and OS run AMX tiles (the only place the server uses it)."""

import sys
from pathlib import Path

import pytest
import torch

from kvpark.kernels import amx_gemm
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.cpu_paged import CpuPagedAttention, amx_prompt_rows_fit
from kvpark.pod.model.linear import pad_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from a_tiles_reference import reference_tiles  # noqa: E402

needs_amx = pytest.mark.skipif(not amx_gemm.usable(),
                               reason="this CPU or OS does not run AMX tiles")

PS, HQ, HKV = 16, 9, 3
LENGTHS = (1, 2, 15, 16, 17, 31, 33, 64, 100, 255, 256, 257, 300, 513, 600)


def make_cache(num_pages: int, head_dim: int = 64, seed: int = 0,
               kv_heads: int = HKV) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, PS, kv_heads, head_dim, generator=g)


def tables(kv_lens: list[int], num_pages: int, seed: int = 1) -> list[list[int]]:
    """Each sequence's pages, scattered over a pool of `num_pages`."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    assert sum(-(-n // PS) for n in kv_lens) <= num_pages
    out, at = [], 0
    for kv_len in kv_lens:
        n = -(-kv_len // PS)
        out.append(order[at:at + n])
        at += n
    return out


def attend(backend: CpuPagedAttention, q: torch.Tensor, cache: torch.Tensor,
           layout: StepLayout) -> torch.Tensor:
    backend.plan(layout)
    return backend.attend(q, cache)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module")
def amx():
    return CpuPagedAttention(amx_prompt_rows=True)


@pytest.fixture(scope="module")
def fp32():
    return CpuPagedAttention()


def reference(q: torch.Tensor, cache: torch.Tensor, table: list[int], kv_len: int
              ) -> torch.Tensor:
    """Causal attention of the last len(q) positions, float64 over bf16-rounded q, k, v."""
    def bf(x):
        return x.bfloat16().double()
    k = torch.cat([cache[p, 0] for p in table])[:kv_len]
    v = torch.cat([cache[p, 1] for p in table])[:kv_len]
    group = q.shape[1] // k.shape[1]
    k, v = bf(k).repeat_interleave(group, 1), bf(v).repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", bf(q), k) * q.shape[-1] ** -0.5
    pos = torch.arange(kv_len - q.shape[0], kv_len)[:, None]
    s = s.masked_fill(torch.arange(kv_len)[None, :] > pos, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


@needs_amx
@pytest.mark.parametrize("head_dim,heads,kv_heads", [
    (64, HQ, HKV), (128, 8, 8), (256, 16, 4), (64, 16, 1)])
def test_prompt_rows_are_attention_to_bf16_accuracy(amx, head_dim, heads, kv_heads):
    n = 600
    cache = make_cache(-(-n // PS) + 4, head_dim, kv_heads=kv_heads)
    table = tables([n], cache.shape[0])[0]
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(2))
    out = attend(amx, q, cache, StepLayout([table], [n], [n], PS, [n]))
    err = (out.double() - reference(q, cache, table, n)).abs()
    # P is rounded to bf16 too (8 bits): a few parts in 1000 of |v| at most
    assert err.max() < 0.02 and err.mean() < 1e-3, (err.max(), err.mean())


@needs_amx
def test_a_prompt_rows_bits_do_not_depend_on_its_step(amx):
    n = max(LENGTHS)
    cache = make_cache(60)
    table = tables([n], 60)[0]
    q = torch.randn(n, HQ, 64, generator=torch.Generator().manual_seed(3))
    whole = attend(amx, q, cache, StepLayout([table], [n], [n], PS, [n]))
    for length in LENGTHS:  # the first `length` rows as one prompt: the same bits
        part = attend(amx, q[:length], cache, StepLayout([table], [length], [length], PS,
                                                         [length]))
        assert same_bits(part, whole[:length]), length
    for offset in (1, 7, 16, 23, 255, 256, 257, 400):  # a later chunk of the prompt
        for length in (1, 17, 100, 200):
            end = min(n, offset + length)
            part = attend(amx, q[offset:end], cache,
                          StepLayout([table], [end], [end - offset], PS, [end - offset]))
            assert same_bits(part, whole[offset:end]), (offset, length)


@needs_amx
def test_a_prompt_rows_bits_do_not_depend_on_the_sequences_beside_it(amx):
    lens = [583, 461, 97, 5, 300]
    cache = make_cache(200)
    tabs = tables(lens, 200)
    qs = [torch.randn(n, HQ, 64, generator=torch.Generator().manual_seed(10 + i))
          for i, n in enumerate(lens)]
    alone = [attend(amx, q, cache, StepLayout([t], [n], [n], PS, [n]))
             for q, t, n in zip(qs, tabs, lens)]
    # one step: the last q_len rows of each, of which the first `prompt` are prompt rows
    q_lens, prompts = [1, 334, 4, 5, 300], [0, 194, 3, 5, 299]
    q = torch.cat([q[n - ql:] for q, n, ql in zip(qs, lens, q_lens)])
    mixed = attend(amx, q, cache, StepLayout(tabs, lens, q_lens, PS, prompts))
    fp32_rows = attend(CpuPagedAttention(), q, cache, StepLayout(tabs, lens, q_lens, PS))
    row = 0
    for i, (n, ql, p) in enumerate(zip(lens, q_lens, prompts)):
        assert same_bits(mixed[row:row + p], alone[i][n - ql:n - ql + p]), i
        # the rows past the prompt: the float32 kernel's bits
        assert same_bits(mixed[row + p:row + ql], fp32_rows[row + p:row + ql]), i
        row += ql


@needs_amx
def test_the_thread_count_does_not_change_a_bit():
    n = 600
    cache = make_cache(60)
    table = tables([n], 60)[0]
    q = torch.randn(n, HQ, 64, generator=torch.Generator().manual_seed(4))
    layout = StepLayout([table], [n], [n], PS, [n])
    one = attend(CpuPagedAttention(num_threads=1, amx_prompt_rows=True), q, cache, layout)
    two = attend(CpuPagedAttention(num_threads=2, amx_prompt_rows=True), q, cache, layout)
    assert same_bits(one, two)


@needs_amx
def test_what_lies_past_a_sequences_tokens_is_never_read(amx):
    n = 70  # the last page is partly filled; whole pages of NaN beside it
    cache = make_cache(40)
    table = tables([n], 40)[0]
    q = torch.randn(n, HQ, 64, generator=torch.Generator().manual_seed(5))
    clean = attend(amx, q, cache, StepLayout([table], [n], [n], PS, [n]))
    dirty = cache.clone()
    last = table[-1]
    dirty[last, :, n % PS:] = float("nan")
    unused = [p for p in range(dirty.shape[0]) if p not in table]
    dirty[unused] = float("nan")
    assert same_bits(attend(amx, q, dirty, StepLayout([table], [n], [n], PS, [n])), clean)


@needs_amx
def test_a_step_without_prompt_rows_is_the_float32_kernels(amx, fp32):
    lens = [300, 40]
    cache = make_cache(40)
    tabs = tables(lens, 40)
    q = torch.randn(2, HQ, 64, generator=torch.Generator().manual_seed(6))
    for prompts in (None, [0, 0]):
        layout = StepLayout(tabs, lens, [1, 1], PS, prompts)
        assert same_bits(attend(amx, q, cache, layout), attend(fp32, q, cache, layout))


@needs_amx
@pytest.mark.parametrize("lens,q_lens,pad", [
    ([600], [600], 0), ([600], [600], 40), ([583, 461, 97, 5], [183, 461, 40, 5], 0),
    ([30], [7], 3)])
def test_the_output_as_a_tiles_is_the_float_output_rounded(amx, lens, q_lens, pad):
    """`attend_tiles` (the o projection's input straight from the kernel): the A tiles of
    `attend`'s float32 rows, each value rounded as torch rounds, zero rows past the step's."""
    cache = make_cache(120)
    layout = StepLayout(tables(lens, 120), lens, q_lens, PS, q_lens)
    q = torch.randn(sum(q_lens), HQ, 64, generator=torch.Generator().manual_seed(7))
    want = attend(amx, q, cache, layout).reshape(len(q), -1)
    tiles = amx.attend_tiles(q, cache, len(q) + pad)
    assert (tiles.rows, tiles.cols) == (len(q) + pad, HQ * 64)
    assert torch.equal(tiles.data, reference_tiles(pad_rows(want, len(q) + pad)))


@needs_amx
def test_no_a_tiles_where_the_step_has_rows_past_a_prompt(amx, fp32):
    """A step with a generated row (or no prompt rows, or the float32 kernel) leaves the
    attention's rows to `attend`: its A tiles would miss them."""
    lens = [300, 40]
    cache = make_cache(40)
    q = torch.randn(41, HQ, 64, generator=torch.Generator().manual_seed(8))
    for backend, layout in ((amx, StepLayout(tables(lens, 40), lens, [40, 1], PS, [40, 0])),
                            (amx, StepLayout(tables(lens, 40), lens, [40, 1], PS)),
                            (fp32, StepLayout(tables(lens, 40), lens, [40, 1], PS, [40, 1]))):
        backend.plan(layout)
        assert backend.attend_tiles(q, cache, 41) is None


def test_head_sizes_the_tiles_take():
    assert amx_prompt_rows_fit(64) and amx_prompt_rows_fit(128) and amx_prompt_rows_fit(256, 16)
    assert not amx_prompt_rows_fit(80) and not amx_prompt_rows_fit(512)
    assert not amx_prompt_rows_fit(64, 17)


@needs_amx
def test_the_server_gives_prompt_rows_amx_where_its_linears_have_it():
    from dataclasses import replace

    from kvpark.pod.args import ServerArgs
    from kvpark.pod.model.synthetic import synthetic_config
    from kvpark.pod.serving.choices import pick_backend

    cpu = torch.device("cpu")
    config = replace(synthetic_config("tiny"), head_dim=64)
    args = ServerArgs(attention_backend="auto")
    assert pick_backend(args, cpu, config, torch.float32, amx_prompt_rows=True).name == "cpu+amx"
    assert pick_backend(args, cpu, config, torch.float32).name == "cpu"
    odd = replace(config, head_dim=48)  # not whole tile rows: float32 prompt rows
    assert pick_backend(args, cpu, odd, torch.float32, amx_prompt_rows=True).name == "cpu"
    wide = replace(config, num_heads=36, num_kv_heads=2)  # 18 query heads a KV head
    assert pick_backend(args, cpu, wide, torch.float32, amx_prompt_rows=True).name == "cpu"


def test_the_runner_marks_the_rows_at_prompt_positions():
    """A prefill chunk, a chunk reaching past the prompt (a recompute replay), a decode row and
    a draft's rows: the layout's prompt rows, and the block mask reads blocks for the others."""
    from types import SimpleNamespace

    from kvpark.pod.worker.runner import ModelRunner

    def item(num_prompt, num_computed, num_rows):
        seq = SimpleNamespace(num_prompt=num_prompt, num_computed=num_computed,
                              page_table=list(range(8)))
        return SimpleNamespace(seq=seq, num_rows=num_rows)

    plan = [item(40, 0, 32), item(40, 32, 20), item(40, 60, 1), item(40, 45, 4)]
    runner = ModelRunner(SimpleNamespace(has_blocks=True), SimpleNamespace(page_size=PS), None)
    assert runner.get_layout(plan).prompt_rows == [32, 8, 0, 0]
    mask = runner.get_block_mask(plan)
    assert mask == [False] * 32 + [False] * 8 + [True] * 12 + [True] + [True] * 4
