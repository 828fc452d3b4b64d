"""Asynchronous swap parks through the scheduler, with a copy engine the test completes by hand.

A sequence whose copy is in flight is neither scheduled nor restored; its pages are neither free
nor in a page table until the copy lands; cancelling it mid-copy gives everything back once the
copy lands, exactly once; and the KV that comes back is the KV that left.
"""

import dataclasses

import torch
from fake_copy import FakeCopyEngine
from page_sets import free_page_ids

from kvpark.pod.core.messages import Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Phase, PreemptMode, Sequence
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.sampling.sampler import SamplingParams


def make(num_pages=16):
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=4, num_kv_heads=1, head_dim=2)
    copy = FakeCopyEngine(pool)
    config = SchedulerConfig(num_slots=2, batch_size=64, preempt_high=1.0, preempt_low=1.0)
    return Scheduler(config, pool, Swapper(pool, HostStore(-1), copy)), pool, copy


def running_seq(scheduler, pool, n_tokens, fill):
    seq = Sequence(Submission(f"r{fill}", (1,) * n_tokens, SamplingParams(temperature=0), None,
                              lambda *a: None), torch.Generator())
    scheduler.add(seq)
    scheduler._admit()
    seq.page_table = pool.allocate(pool.pages_for(n_tokens))
    seq.num_computed = n_tokens - 1  # one token waits to be fed
    for cache in pool.caches:
        cache[seq.page_table] = fill
    return seq


def test_park_in_flight_holds_its_pages_until_the_copy_lands():
    scheduler, pool, copy = make()
    seq = running_seq(scheduler, pool, 10, fill=3.0)
    pages = list(seq.page_table)
    assert scheduler.park(seq, wait=False) is PreemptMode.SWAP
    assert seq.phase is Phase.PARKED and scheduler.swapper.is_busy(seq)
    assert not set(pages) & set(free_page_ids(pool))  # a park still reads them
    assert sorted(scheduler.swapper.pages_in_flight) == sorted(pages)
    assert scheduler.schedule() == []  # neither scheduled nor restored while in flight
    assert seq.phase is Phase.PARKED
    copy.complete(copy.in_flight[0])
    scheduler.reap_copies()
    assert set(pages) <= set(free_page_ids(pool)) and not scheduler.swapper.pages_in_flight
    assert torch.all(seq.parking.host_kv == 3.0)


def test_resume_in_flight_wakes_the_sequence_only_when_the_bytes_landed():
    scheduler, pool, copy = make()
    seq = running_seq(scheduler, pool, 10, fill=5.0)
    scheduler.park(seq, wait=False)
    copy.complete(copy.in_flight[0])
    for cache in pool.caches:
        cache.zero_()  # whatever was in the pool is gone
    plan = scheduler.schedule()  # reaps the park, then starts the resume
    assert plan == [] and seq.phase is Phase.PARKED and scheduler.swapper.is_busy(seq)
    copy.complete(copy.in_flight[0])
    plan = scheduler.schedule()
    assert seq.phase is Phase.RUNNING and [item.seq for item in plan] == [seq]
    for cache in pool.caches:
        assert torch.all(cache[seq.page_table][:, :, :] == 5.0)
    assert scheduler.swapper.host.held_bytes == 0 and scheduler.stats.n_resume == 1


def test_cancel_mid_copy_frees_everything_once_the_copy_lands():
    scheduler, pool, copy = make()
    seq = running_seq(scheduler, pool, 10, fill=1.0)
    finished = []
    seq.request = dataclasses.replace(seq.request, sink=lambda event: finished.append(
        event.kind) if event.kind == "finished" else None)
    scheduler.park(seq, wait=False)
    held = scheduler.swapper.host.held_bytes
    scheduler.finish(seq, reason="cancelled")
    assert finished == ["finished"] and seq.is_finished
    assert scheduler.swapper.host.held_bytes == held > 0  # nothing given back while the copy runs
    assert pool.num_free_pages == pool.num_pages - 3
    assert scheduler.has_work  # the engine keeps stepping to reap it
    copy.complete(copy.in_flight[0])
    scheduler.reap_copies()
    assert pool.num_free_pages == pool.num_pages and scheduler.swapper.host.held_bytes == 0
    assert not scheduler.has_work and finished == ["finished"]


def test_cancel_mid_resume_frees_the_new_pages_and_the_host_buffer():
    scheduler, pool, copy = make()
    seq = running_seq(scheduler, pool, 10, fill=1.0)
    scheduler.park(seq, wait=False)
    copy.complete(copy.in_flight[0])
    scheduler.schedule()  # starts the resume
    assert scheduler.swapper.is_busy(seq) and pool.num_free_pages == pool.num_pages - 3
    scheduler.finish(seq, reason="cancelled")
    copy.complete(copy.in_flight[0])
    scheduler.reap_copies()
    assert pool.num_free_pages == pool.num_pages and scheduler.swapper.host.held_bytes == 0
