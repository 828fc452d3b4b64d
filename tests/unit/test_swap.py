"""The park state machine around asynchronous copies, and the `Swapper` that carries parks out:
swap while the budget allows, recompute otherwise or when the host refuses the buffer."""

import pytest
import torch
from fake_copy import FakeCopyEngine
from test_kv_copy import filled_pool

from kvpark.kernels.kv_copy import CopyKind, SyncCopyEngine
from kvpark.pod.core import preemption as policy
from kvpark.pod.core.messages import Submission
from kvpark.pod.core.sequence import PreemptMode, Sequence
from kvpark.pod.core.swap import ParkResult, Resumed, Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.transfers import Outcome, ParkTransfer, TransferTracker
from kvpark.pod.sampling.sampler import SamplingParams


def make_seq(pool: KVPool, num_pages: int) -> Sequence:
    tokens = num_pages * pool.page_size
    seq = Sequence(Submission("r", (1,) * (tokens + 1), SamplingParams(temperature=0), None,
                              lambda *a: None), torch.Generator())
    seq.page_table, seq.num_computed = pool.allocate(num_pages), tokens
    return seq


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


def park(swapper: Swapper, seq, wait: bool = True) -> ParkResult:
    """What the scheduler does: the swapper's plan, the policy's mode, the swapper's park."""
    plan = swapper.plan_park(seq)
    mode = policy.choose_mode(plan.swap_bytes, plan.budget_bytes, plan.held_bytes)
    return swapper.park(seq, plan, mode, wait)


def test_wait_all_waits_for_every_copy():
    pool = filled_pool()
    engine = FakeCopyEngine(pool)
    swapper = Swapper(pool, HostStore(-1), engine)
    seqs = [make_seq(pool, num_pages=2) for _ in range(3)]
    for s in seqs:
        park(swapper, s, wait=False)
    assert swapper.num_in_flight == 3
    with pytest.raises(AssertionError, match="never completed"):
        swapper.wait_all()
    for ticket in list(engine.in_flight):
        engine.complete(ticket)
    assert swapper.wait_all() == []  # parks landed: nobody resumed
    assert swapper.num_in_flight == 0 and pool.num_free_pages == pool.num_pages



def test_swap_park_then_resume_restores_the_bytes_into_new_pages():
    pool = filled_pool()
    host = HostStore(-1)
    swapper = Swapper(pool, host, SyncCopyEngine(pool))
    seq = make_seq(pool, num_pages=3)
    before = [cache[seq.page_table].clone() for cache in pool.caches]
    assert park(swapper, seq).mode is PreemptMode.SWAP
    assert pool.num_free_pages == 8  # the scheduler empties the page table
    assert host.held_bytes == seq.parking.host_bytes == pool.swap_bytes(3)
    pool.allocate(2)  # someone else takes the low pages meanwhile
    for cache in pool.caches:
        cache.zero_()
    resumed = swapper.resume(seq)
    assert resumed.num_computed == seq.num_computed and resumed.replay_until == 0
    for cache, old in zip(pool.caches, before):
        assert cache[resumed.page_table].numpy().tobytes() == old.numpy().tobytes()
    assert host.held_bytes == 0 and seq.parking.host_kv is None


@pytest.mark.parametrize("budget", [0, 1])
def test_over_the_budget_a_park_drops_the_pages_for_a_replay(budget):
    pool = filled_pool()
    swapper = Swapper(pool, HostStore(budget))
    seq = make_seq(pool, num_pages=2)
    assert park(swapper, seq) == ParkResult(PreemptMode.RECOMPUTE, fell_back=False)
    assert seq.parking.host_kv is None and pool.num_free_pages == 8
    seq.parking.replay_until, seq.num_computed = 8, 0  # the scheduler's part of the park
    assert swapper.resume(seq) == Resumed([], 0, replay_until=8)


def test_a_refused_host_buffer_falls_through_to_recompute(monkeypatch):
    pool = filled_pool()
    host = HostStore(-1)
    swapper = Swapper(pool, host)

    def refuse(shape, dtype):
        from kvpark.pod.memory.host_store import HostAllocationError
        raise HostAllocationError("refused")

    monkeypatch.setattr(host, "allocate", refuse)
    seq = make_seq(pool, num_pages=2)
    assert park(swapper, seq) == ParkResult(PreemptMode.RECOMPUTE, fell_back=True)
    assert pool.num_free_pages == 8


def test_cancel_gives_back_pages_and_host_bytes():
    pool = filled_pool()
    host = HostStore(-1)
    swapper = Swapper(pool, host)
    running, parked = make_seq(pool, num_pages=2), make_seq(pool, num_pages=3)
    park(swapper, parked)
    parked.page_table = []  # the scheduler's part of the park
    swapper.cancel(running)
    swapper.cancel(parked)
    assert pool.num_free_pages == 8 and host.held_bytes == 0
    assert parked.parking.host_kv is None
