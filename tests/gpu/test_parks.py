"""Parks on the GPU: swap copies byte-exact (sync and async engines), and whole runs with forced
swap and recompute parks through the scheduler, runner and engine."""

import pytest
import torch
from gpu_common import DEVICE, DTYPE

from kvpark.kernels.flashinfer_paged import AttentionShape, FlashInferPagedAttention
from kvpark.kernels.kv_copy import CudaAsyncCopyEngine, SyncCopyEngine, make_copy_engine
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Sequence
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.sampling.sampler import SamplingParams
from kvpark.pod.worker.runner import ModelRunner

pytestmark = pytest.mark.gpu

PAGE_SIZE = 16


def filled_pool(num_pages=48) -> KVPool:
    pool = KVPool(num_layers=4, num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=3,
                  head_dim=64, dtype=DTYPE, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for cache in pool.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen, device=DEVICE, dtype=DTYPE))
    return pool


def make_engine(pool, kind):
    return SyncCopyEngine(pool) if kind == "sync" else CudaAsyncCopyEngine(pool)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("pages,targets", [([3, 4, 5, 6], [20, 21, 22, 23]),
                                           ([9, 2, 30], [41, 7, 13])])
def test_swap_park_and_resume_are_byte_exact(kind, pages, targets):
    pool = filled_pool()
    before = [cache[pages].clone() for cache in pool.caches]
    host = HostStore(-1, pin_memory=True)
    buffer = host.allocate(pool.swap_shape(len(pages)), pool.dtype)
    engine = make_engine(pool, kind)
    ticket = engine.start_park(pages, buffer)
    engine.wait(ticket)
    assert engine.poll(ticket)
    for layer, old in enumerate(before):
        assert torch.equal(buffer[layer].to(DEVICE), old)
    for cache in pool.caches:
        cache[pages] = 0  # the pages go to someone else meanwhile
    ticket = engine.start_resume(targets, buffer)
    engine.wait(ticket)
    for cache, old in zip(pool.caches, before):
        assert torch.equal(cache[targets], old)


def test_async_park_sees_writes_queued_before_it():
    """The copy stream waits for the compute stream: a park started right after a queued
    write of the victim's pages copies the written values, not the old ones."""
    pool = filled_pool()
    engine = CudaAsyncCopyEngine(pool)
    host = HostStore(-1, pin_memory=True)
    pages = [10, 11, 12]
    buffer = host.allocate(pool.swap_shape(len(pages)), pool.dtype)
    busy = torch.randn(4096, 4096, device=DEVICE)
    for _ in range(8):  # keep the compute stream busy so a missing wait would race
        busy = busy @ busy / 64
    for cache in pool.caches:
        cache[pages] = 3.0
    ticket = engine.start_park(pages, buffer)
    engine.wait(ticket)
    assert bool((buffer == 3.0).all())


def test_async_engine_is_the_cuda_default(monkeypatch):
    pool = filled_pool(num_pages=4)
    assert isinstance(make_copy_engine(pool), CudaAsyncCopyEngine)
    assert isinstance(make_copy_engine(pool, async_copies=False), SyncCopyEngine)


def make_seq(prompt_len: int, max_tokens: int) -> Sequence:
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 49152, (prompt_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(Submission(f"r{prompt_len}", tuple(prompt), params, None,
                               lambda seq, kind, token: False), torch.Generator())


@pytest.mark.parametrize("backend_name", ["torch", "flashinfer"])
@pytest.mark.parametrize("budget,mode", [(0, "recompute"), (-1, "swap")])
def test_forced_parks_run_to_completion(request, smollm2, backend_name, budget, mode):
    c = smollm2.config
    pool = KVPool(c.num_layers, 32, PAGE_SIZE, c.num_kv_heads, c.head_dim, DTYPE, DEVICE)
    if backend_name == "flashinfer":
        request.getfixturevalue("flashinfer")
        backend = FlashInferPagedAttention(DEVICE, AttentionShape(
            c.num_heads, c.num_kv_heads, c.head_dim, PAGE_SIZE, DTYPE, DTYPE))
    else:
        backend = TorchPagedAttention(DEVICE)
    config = SchedulerConfig(num_slots=3, batch_size=64, preempt=True, preempt_every=4)
    scheduler = Scheduler(config, pool, Swapper(pool, HostStore(budget, pin_memory=True)))
    engine = Engine(scheduler, ModelRunner(smollm2, pool, backend))
    seqs = [make_seq(n, max_tokens=12) for n in (20, 37, 70)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(400):
        if not scheduler.has_work:
            break
        engine.step()
    assert [(s.finish_reason, s.num_generated) for s in seqs] == [("length", 12)] * 3
    stats = scheduler.stats
    if mode == "recompute":
        assert stats.n_preempt_recompute > 0 and stats.n_recompute_tokens > 0
    else:
        assert stats.n_preempt_swap > 0 and stats.n_preempt_recompute == 0
    assert stats.n_resume == stats.n_preempt
    assert pool.num_free_pages == pool.num_pages
