"""Copy engines on the CPU (the park state machine around them: test_swap.py)."""

import pytest
import torch
from fake_copy import FakeCopyEngine

from kvpark.kernels import kv_copy
from kvpark.kernels.cbuild import KernelUnavailable, load_library
from kvpark.kernels.kv_copy import (
    CudaAsyncCopyEngine,
    SyncCopyEngine,
    copy_pages_in_c,
    load_pages,
    make_copy_engine,
    save_pages,
)
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


# ---- host-tier pages: one C call on the CPU ----------------------------------------------------
def c_kernels_build() -> bool:
    try:
        load_library()
        return True
    except KernelUnavailable:
        return False


@pytest.mark.skipif(not c_kernels_build(), reason="no working C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_and_loaded_pages_are_the_pools_bytes(dtype, monkeypatch):
    """`save_pages` fills each host page with that page of every layer (the bytes a torch.stack
    gives), `load_pages` puts them back at other pages, in any order, 1 to 9 pages a call; both
    in one C call each."""
    done = []
    real = kv_copy.copy_pages_in_c
    monkeypatch.setattr(kv_copy, "copy_pages_in_c",
                        lambda *a, **k: done.append(real(*a, **k)) or done[-1])
    pool = KVPool(num_layers=3, num_pages=24, page_size=4, num_kv_heads=2, head_dim=3,
                  dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    for cache in pool.caches:  # each layer its own values
        cache.copy_(torch.randn(cache.shape, generator=gen))
    for pages, targets in [([5], [20]), ([7, 1, 3], [9, 10, 2]), (list(range(9)), [23] + list(
            range(12, 20)))]:
        host = [torch.empty(len(pool.caches), *pool.page_shape, dtype=dtype) for _ in pages]
        save_pages(pool, pages, host)
        for page, host_page in zip(pages, host):
            expect = torch.stack([cache[page] for cache in pool.caches])
            assert torch.equal(host_page.view(torch.uint8), expect.view(torch.uint8))
        load_pages(pool, targets, host)
        for cache in pool.caches:
            assert torch.equal(cache[targets].view(torch.uint8), cache[pages].view(torch.uint8))
    assert done == [True] * 6


def test_pages_the_c_copy_cannot_take_go_through_torch():
    """A host page of another dtype or a strided one: torch copies it (and converts)."""
    pool = filled_pool()
    host = [torch.empty(2, 2, 4, 2, 3, dtype=torch.float64)]
    assert not copy_pages_in_c(pool, [3], host, to_host=True)
    save_pages(pool, [3], host)
    assert torch.equal(host[0], torch.stack([cache[3] for cache in pool.caches]).double())
    strided = torch.empty(2, 2, 4, 2, 6)[..., ::2]
    assert not copy_pages_in_c(pool, [4], [strided], to_host=True)
    save_pages(pool, [4], [strided])
    assert torch.equal(strided, torch.stack([cache[4] for cache in pool.caches]))
