"""Copy engines on the CPU and the park state machine around asynchronous copies."""

import pytest
import torch

from kvpark.kernels.kv_copy import (
    CopyKind,
    CudaAsyncCopyEngine,
    FakeCopyEngine,
    Outcome,
    ParkTransfer,
    SyncCopyEngine,
    TransferTracker,
    make_copy_engine,
)
from kvpark.pod.host_store import HostStore
from kvpark.pod.kv_pool import KVPool


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


# ---- the state machine ---------------------------------------------------------------------------
def test_park_settles_into_a_swap_park():
    transfer = ParkTransfer(CopyKind.PARK, (4, 5))
    release = transfer.settle()
    assert release.outcome is Outcome.PARKED
    assert release.free_pages == (4, 5) and not release.release_host
    with pytest.raises(AssertionError, match="settles once"):
        transfer.settle()


def test_resume_settles_into_running():
    release = ParkTransfer(CopyKind.RESUME, (1, 2)).settle()
    assert release.outcome is Outcome.RESUMED
    assert release.free_pages == () and release.release_host


@pytest.mark.parametrize("kind", list(CopyKind))
def test_cancelled_transfer_gives_back_everything(kind):
    transfer = ParkTransfer(kind, (7,))
    transfer.cancel()
    release = transfer.settle()
    assert release.outcome is Outcome.CANCELLED
    assert release.free_pages == (7,) and release.release_host


class Owner:
    """A sequence as the scheduler would track it: pages, a host buffer, a cancel flag."""

    def __init__(self, name):
        self.name = name


def test_tracker_with_fake_engine_park_resume_cancel():
    pool = filled_pool(num_pages=6)
    host = HostStore(budget_bytes=-1)
    engine = FakeCopyEngine(pool)
    tracker = TransferTracker()
    a, b = Owner("a"), Owner("b")
    pages_a = pool.allocate(2)
    pages_b = pool.allocate(2)
    buf_a = host.allocate(pool.swap_shape(2), pool.dtype)
    buf_b = host.allocate(pool.swap_shape(2), pool.dtype)
    ticket_a = engine.start_park(pages_a, buf_a)
    ticket_b = engine.start_park(pages_b, buf_b)
    tracker.start(a, ticket_a)
    tracker.start(b, ticket_b)
    assert tracker.is_busy(a) and tracker.is_busy(b) and len(tracker) == 2
    with pytest.raises(AssertionError, match="already has a copy"):
        tracker.start(a, ticket_a)

    def apply(reaped):
        for _, release, ticket in reaped:
            pool.free(list(release.free_pages))
            if release.release_host:
                host.release(ticket.host_buf)
        return [(owner.name, release.outcome) for owner, release, _ in reaped]

    # nothing has landed: nothing is given back, whatever is cancelled meanwhile
    assert apply(tracker.reap(engine.poll)) == []
    assert tracker.cancel(b) is True
    assert apply(tracker.reap(engine.poll)) == []
    assert pool.num_free_pages == 2 and host.held_bytes == 2 * pool.swap_bytes(2)

    engine.complete(ticket_b)  # the cancelled copy lands: its pages and host bytes come back
    assert apply(tracker.reap(engine.poll)) == [("b", Outcome.CANCELLED)]
    assert pool.num_free_pages == 4 and host.held_bytes == pool.swap_bytes(2)
    assert not tracker.is_busy(b) and tracker.cancel(b) is False
    assert apply(tracker.reap(engine.poll)) == []  # settled exactly once

    engine.complete(ticket_a)  # a is now parked by swap: pages free, host bytes still held
    assert apply(tracker.reap(engine.poll)) == [("a", Outcome.PARKED)]
    assert pool.num_free_pages == 6 and host.held_bytes == pool.swap_bytes(2)
    assert torch.equal(buf_a[1], filled_pool(num_pages=6).caches[1][pages_a])

    # resume a into other pages; cancelled mid-copy, it frees the new pages and the host buffer
    new_pages = pool.allocate(2)
    ticket = engine.start_resume(new_pages, buf_a)
    tracker.start(a, ticket)
    tracker.cancel(a)
    assert apply(tracker.reap(engine.poll)) == [] and pool.num_free_pages == 4
    engine.complete(ticket)
    assert apply(tracker.reap(engine.poll)) == [("a", Outcome.CANCELLED)]
    assert pool.num_free_pages == 6 and host.held_bytes == 0


def test_drain_waits_for_every_copy():
    engine = FakeCopyEngine()
    tracker = TransferTracker()
    tickets = [engine.start_park([i], torch.zeros(1)) for i in range(3)]
    for owner, ticket in enumerate(tickets):
        tracker.start(owner, ticket)
    with pytest.raises(AssertionError, match="never completed"):
        tracker.drain(engine.wait)
    for ticket in tickets:
        engine.complete(ticket)
    assert [owner for owner, _, _ in tracker.drain(engine.wait)] == [0, 1, 2]
    assert len(tracker) == 0
