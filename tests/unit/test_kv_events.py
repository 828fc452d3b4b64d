"""KV events as the memory layer records them (issue 43): a run of chained pages is one
`BlocksStored` with its tokens; a parked sequence's full pages are reported on CPU (the host
tier holds them, findable by any request with that prefix) and its resumed pages on GPU; a
page dropped from the tier is removed from CPU; a fresh log starts with `AllCleared`."""

from test_host_tier import flush_pool, make
from test_prefix_cache import PS, make_seq, run_to

from kvpark.pod.core.sequence import PreemptMode
from kvpark.pod.memory.kv_events import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventLog,
    external_hash,
)


def with_events(**kwargs):
    scheduler, pool, tier = make(**kwargs)
    log = KvEventLog(PS)
    pool.cache.events = tier.events = log
    return scheduler, pool, tier, log


def stored(events, medium):
    return [e for e in events if isinstance(e, BlocksStored) and e.medium == medium]


def removed(events, medium):
    return {h for e in events if isinstance(e, BlocksRemoved) and e.medium == medium
            for h in e.hashes}


def test_a_fresh_log_says_all_cleared_once():
    log = KvEventLog(PS)
    assert log.drain() == [AllCleared()] and log.drain() == []


def test_a_prompts_pages_are_one_run_with_their_tokens_and_no_parent():
    scheduler, pool, tier, log = with_events()
    prompt = list(range(1, 14))  # three full pages
    seq = make_seq(prompt)
    scheduler.add(seq)
    run_to(scheduler, seq, 13)
    [run] = stored(log.drain(), "GPU")
    assert run.parent is None and run.block_size == PS
    assert run.hashes == tuple(external_hash(h) for h in seq.page_hashes[:3])
    assert run.token_ids == tuple(prompt[:3 * PS])


def test_an_evicted_page_leaves_the_pool_and_is_stored_on_the_host_with_its_parent():
    scheduler, pool, tier, log = with_events()
    seq = make_seq(list(range(1, 14)))
    scheduler.add(seq)
    run_to(scheduler, seq, 13)
    hashes = [external_hash(h) for h in seq.page_hashes[:3]]
    scheduler.finish(seq, reason="stop")
    log.drain()
    flush_pool(pool)
    events = log.drain()
    assert removed(events, "GPU") == set(hashes)
    on_host = {h: e for e in stored(events, "CPU") for h in e.hashes}
    assert set(on_host) == set(hashes)
    assert on_host[hashes[2]].parent == hashes[1]  # each page names its predecessor


def test_a_parked_sequences_full_pages_are_reported_on_the_cpu_while_parked():
    scheduler, pool, tier, log = with_events(num_pages=12)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)  # three full pages, two tokens of a fourth
    log.drain()
    assert scheduler.park(seq) is PreemptMode.SWAP
    hashes = {external_hash(h) for h in seq.page_hashes[:3]}
    events = log.drain()
    assert {h for e in stored(events, "CPU") for h in e.hashes} == hashes  # not the partial
    scheduler.resume(seq)
    assert not removed(log.drain(), "CPU")  # resumed, still cached on the host


def test_a_page_the_tier_drops_is_removed_from_the_cpu():
    scheduler, pool, tier, log = with_events(num_pages=8, cap_pages=1)
    seq = make_seq(list(range(1, 14)))
    scheduler.add(seq)
    run_to(scheduler, seq, 13)
    scheduler.finish(seq, reason="stop")
    flush_pool(pool)  # three evicted pages, room on the host for one
    events = log.drain()
    kept = {h for e in stored(events, "CPU") for h in e.hashes}
    assert len(kept - removed(events, "CPU")) == 1
