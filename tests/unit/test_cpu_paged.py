"""The C paged attention (kernels/cpu_paged.py): bit-level row invariance, strided q, long
contexts, the build. Its agreement with plain attention is in test_torch_paged.py."""

import threading
import time

import pytest
import torch
from test_torch_paged import plain_causal_attention, relative_error

from kvpark.kernels import cbuild, cpu_paged, worker_pool
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.cbuild import KernelUnavailable
from kvpark.kernels.cpu_features import Isa, detect
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.kernels.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.skipif(not cpu_paged.is_available(),
                                reason="no working C compiler for the CPU kernel")


def step_output(backend, cache, tables, kv_lens, q_lens, q):
    backend.plan(StepLayout(tables, kv_lens, q_lens, 16))
    return backend.attend(q, cache)


def test_a_row_has_the_same_bits_alone_beside_others_and_as_a_prefill_row(isa):
    """Decode row of sequence A at position 99: alone, beside two other sequences, and as the
    last row of a 40-token prefill chunk (a recompute replay) - the same bits every time."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d = 9, 3, 64
    cache = torch.randn(40, 2, 16, hkv, d, generator=gen)
    table_a, table_b, table_c = list(range(0, 7)), list(range(10, 20)), list(range(30, 33))
    rows_a = torch.randn(40, hq, d, generator=gen)  # queries of A's positions 60..99
    others = torch.randn(6, hq, d, generator=gen)
    backend = CpuPagedAttention(isa=isa)
    alone = step_output(backend, cache, [table_a], [100], [1], rows_a[-1:])
    beside = step_output(backend, cache, [table_b, table_a, table_c], [150, 100, 40],
                         [5, 1, 1], torch.cat([others[:5], rows_a[-1:], others[5:]]))[5:6]
    in_prefill = step_output(backend, cache, [table_c, table_a], [40, 100], [1, 40],
                             torch.cat([others[:1], rows_a]))[-1:]
    assert torch.equal(alone, beside)
    assert torch.equal(alone, in_prefill)


def same_bytes(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("hq,hkv,d,page_size", [(9, 3, 64, 16), (4, 2, 24, 4), (10, 2, 64, 16),
                                                (10, 2, 128, 8)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rows_past_a_chunk_have_the_same_bits_whoever_computes_them(isa, hq, hkv, d, page_size,
                                                                   kv_dtype):
    """A row's prefix is cut into chunks of 256 positions; a step of few rows hands its chunks to
    different threads. Rows at the chunk edges (255..257, 511..513) and at 700 give the same
    bytes as decode rows alone on 1, 2 or 3 threads, beside a neighbour, and inside prefill chunks
    that straddle an edge (split by chunk or not) - and match plain attention. A float32 or a
    bf16 pool (head dims 64 and 128 read by pairs, a KV head's query heads taking each V row in
    sets of up to 4 or 2; 24 widened a row at a time)."""
    gen = torch.Generator().manual_seed(13)
    kv_len, other_pages = 701, 8
    pages = -(-kv_len // page_size)
    k, v = torch.randn(kv_len, hkv, d, generator=gen), torch.randn(kv_len, hkv, d, generator=gen)
    cache = torch.randn(pages + other_pages, 2, page_size, hkv, d, generator=gen)
    table = (torch.randperm(pages, generator=gen) + other_pages).tolist()  # scattered pages
    padding = torch.zeros(pages * page_size - kv_len, hkv, d)
    cache[table, 0] = torch.cat([k, padding]).view(pages, page_size, hkv, d)
    cache[table, 1] = torch.cat([v, padding]).view(pages, page_size, hkv, d)
    cache = cache.to(kv_dtype)
    k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()  # the values the pool holds
    q = torch.randn(kv_len, hq, d, generator=gen)  # the query of every position
    other_q = torch.randn(5, hq, d, generator=gen)

    def run(threads, tables, kv_lens, q_lens, rows):
        backend = CpuPagedAttention(isa=isa, num_threads=threads)
        backend.plan(StepLayout(tables, kv_lens, q_lens, page_size))
        return backend.attend(rows, cache)

    positions = [0, 255, 256, 257, 511, 512, 513, 700]
    alone = {p: run(1, [table], [p + 1], [1], q[p:p + 1]) for p in positions}
    for p in positions:
        for threads in (2, 3):
            assert same_bytes(run(threads, [table], [p + 1], [1], q[p:p + 1]), alone[p])
        beside = run(2, [list(range(other_pages)), table], [20, p + 1], [5, 1],
                     torch.cat([other_q, q[p:p + 1]]))
        assert same_bytes(beside[5:], alone[p])
    for first, q_len in [(250, 16), (500, 20), (0, kv_len)]:
        for threads in (1, 2):
            out = run(threads, [table], [first + q_len], [q_len], q[first:first + q_len])
            for p in positions:
                if first <= p < first + q_len:
                    assert same_bytes(out[p - first:p - first + 1], alone[p]), (first, p)
    assert relative_error(out, plain_causal_attention(q, k, v, 0)) < 1e-5


def test_kernel_threads_do_not_change_the_bits(isa):
    """The worker pool splits (sequence, row tile) items, and a step of few tiles by chunks of
    positions: 1, 2 and 3 threads give the same bytes, torch's own thread count aside."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(64, 2, 16, 3, 64, generator=gen)
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(4)]
    q = torch.randn(4 + 30, 9, 64, generator=gen)
    layout_args = (tables, [250, 200, 256, 31], [1, 1, 1, 31])
    outs = [step_output(CpuPagedAttention(isa=isa, num_threads=threads), cache, *layout_args, q)
            for threads in (1, 2, 3)]
    assert worker_pool.num_workers(isa) >= 2  # the pool really ran them
    for out in outs[1:]:
        assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))


def test_an_idle_pool_sleeps(isa):
    """Workers spin for at most 100 us after a call, then block: an idle pool takes no CPU."""
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(8, 2, 16, 3, 64, generator=gen)
    q = torch.randn(32, 9, 64, generator=gen)  # 4 row tiles: enough to split
    step_output(CpuPagedAttention(isa=isa, num_threads=2), cache, [list(range(8))], [100], [32],
                q)
    assert worker_pool.num_workers(isa) >= 1
    before_cpu, before_wall = time.process_time(), time.perf_counter()
    threading.Event().wait(0.3)  # a window to measure in, not a synchronisation
    spent = time.process_time() - before_cpu
    assert spent < 0.1 * (time.perf_counter() - before_wall), f"idle pool used {spent:.3f} s CPU"


def test_reads_a_strided_q_like_the_fused_qkv_view(isa):
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(5, (hq + hkv) * d, generator=gen)
    q = qkv.view(5, hq + hkv, d)[:, :hq]  # row stride (hq + hkv) * d, like the model's view
    cache = torch.randn(8, 2, 16, hkv, d, generator=gen)
    args = ([[0, 1], [2, 3, 4]], [20, 40], [1, 4], q)
    got = step_output(CpuPagedAttention(isa=isa), cache, *args[:3], q)
    want = step_output(TorchPagedAttention(), cache, *args[:3], q.contiguous())
    assert relative_error(got, want) < 1e-5


def test_append_kv_writes_the_rows_the_torch_reference_writes(isa, monkeypatch):
    """The C append (one call a layer) and the reference's index_copy_ leave the same bytes,
    k and v strided like views of the fused qkv output; other dtypes take the reference."""
    hq, hkv, d, ps = 9, 3, 64, 16
    layout = StepLayout([[5, 2], [7], [0, 3, 4]], [20, 1, 40], [20, 1, 3], ps)
    qkv = torch.randn(24, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(3))
    k = qkv[:, hq * d:(hq + hkv) * d].view(24, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(24, hkv, d)
    caches = []
    for backend in (CpuPagedAttention(isa=isa), TorchPagedAttention()):
        cache = torch.zeros(8, 2, ps, hkv, d)
        backend.plan(layout)
        if isinstance(backend, CpuPagedAttention):  # float32: the C call, not the reference's
            with monkeypatch.context() as m:
                m.setattr(TorchPagedAttention, "append_kv", None)
                backend.append_kv(cache, k, v)
        else:
            backend.append_kv(cache, k, v)
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.int32), caches[1].view(torch.int32))
    assert caches[0].abs().sum() > 0
    half = torch.zeros(8, 2, ps, hkv, d, dtype=torch.float16)
    backend = CpuPagedAttention(isa=isa)
    backend.plan(layout)
    backend.append_kv(half, k, v)  # not float32: the reference's path, converted
    assert torch.equal(half, caches[1].half())


def test_long_context_matches_plain_attention(isa):
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, kv_len = 9, 3, 64, 3000
    k, v = torch.randn(kv_len, hkv, d, generator=gen), torch.randn(kv_len, hkv, d, generator=gen)
    pages = -(-kv_len // 16)
    cache = torch.zeros(pages, 2, 16, hkv, d)
    padding = torch.zeros(pages * 16 - kv_len, hkv, d)
    cache[:, 0] = torch.cat([k, padding]).view(pages, 16, hkv, d)
    cache[:, 1] = torch.cat([v, padding]).view(pages, 16, hkv, d)
    q = torch.randn(1, hq, d, generator=gen) * 4  # sharp softmax: exp over a wide range
    got = step_output(CpuPagedAttention(isa=isa), cache, [list(range(pages))], [kv_len], [1], q)
    assert relative_error(got, plain_causal_attention(q, k, v, kv_len - 1)) < 1e-5


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(KernelUnavailable, match="failed on broken.c"):
        cbuild.build(broken)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelUnavailable, match="did not run"):
        cbuild.build(broken)


def test_the_build_is_cached_per_source(tmp_path, monkeypatch):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    first = cbuild.build(cpu_paged.SOURCE)
    mtime = first.stat().st_mtime_ns
    assert cbuild.build(cpu_paged.SOURCE) == first and first.stat().st_mtime_ns == mtime
    library = cbuild.build(cbuild.SOURCES)  # kernels and their worker pool: one library
    assert cbuild.build(cbuild.SOURCES) == library != first
    other = tmp_path / "other.c"
    other.write_text("int f(void) { return 1; }\n")
    changed = cbuild.build(other)
    other.write_text("int f(void) { return 1; }\n/* changed */\n")
    assert cbuild.build(other) != changed


def test_each_isa_is_its_own_build_and_an_unrunnable_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    runnable = detect().isas
    builds = {cbuild.build(cpu_paged.SOURCE, isa) for isa in runnable}
    assert len(builds) == len(runnable)
    assert cbuild.build(cpu_paged.SOURCE) == cbuild.build(cpu_paged.SOURCE, runnable[0])
    for isa in set(Isa) - set(runnable):
        with pytest.raises(KernelUnavailable, match="cannot run"):
            cbuild.build(cpu_paged.SOURCE, isa)
