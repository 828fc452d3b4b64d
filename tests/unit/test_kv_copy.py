"""Copy engines on the CPU (the park state machine around them: test_swap.py)."""

import pytest
import torch
from fake_copy import FakeCopyEngine

from kvpark.kernels.kv_copy import CudaAsyncCopyEngine, SyncCopyEngine, make_copy_engine
from kvpark.pod.memory.kv_pool import KVPool


def filled_pool(num_pages=8, seed=0) -> KVPool:
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=4, num_kv_heads=2, head_dim=3)
    gen = torch.Generator().manual_seed(seed)
    for cache in pool.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return pool


def host_buffer(pool: KVPool, num_pages: int) -> torch.Tensor:
    return torch.zeros(pool.swap_shape(num_pages), dtype=pool.dtype)


# ---- engines -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pages,targets", [([1, 2, 3], [5, 6, 7]), ([6, 0, 3], [2, 7, 4])])
def test_sync_park_then_resume_is_byte_exact(pages, targets):
    pool = filled_pool()
    before = [cache[pages].clone() for cache in pool.caches]
    engine = SyncCopyEngine(pool)
    host = host_buffer(pool, len(pages))
    assert engine.poll(engine.start_park(pages, host))
    for cache in pool.caches:
        cache[pages] = 0  # the pages are reused by someone else meanwhile
    assert engine.poll(engine.start_resume(targets, host))
    for cache, old in zip(pool.caches, before):
        assert torch.equal(cache[targets], old)


def test_fake_ticket_is_in_flight_until_completed():
    pool = filled_pool()
    engine = FakeCopyEngine(pool)
    host = host_buffer(pool, 2)
    ticket = engine.start_park([3, 4], host)
    assert not engine.poll(ticket) and engine.in_flight == [ticket]
    assert torch.count_nonzero(host) == 0  # bytes land only with the completion
    with pytest.raises(AssertionError, match="never completed"):
        engine.wait(ticket)
    engine.complete(ticket)
    assert engine.poll(ticket) and engine.in_flight == []
    engine.wait(ticket)
    assert torch.equal(host[0], pool.caches[0][[3, 4]])


def test_engine_choice():
    pool = filled_pool()
    assert isinstance(make_copy_engine(pool), SyncCopyEngine)  # CPU: always synchronous
    with pytest.raises(AssertionError, match="CUDA pool"):
        CudaAsyncCopyEngine(pool)


def test_an_empty_page_list_copies_nothing():
    pool = filled_pool()
    engine = SyncCopyEngine(pool)
    host = host_buffer(pool, 0)
    assert engine.poll(engine.start_park([], host)) and engine.poll(engine.start_resume([], host))
