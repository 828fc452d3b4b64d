"""The host tier: pages the pool's cache evicts kept in host RAM under the --preempt-ram budget,
copied back byte for byte at admission and resume; parks keep their full pages there, take
room from cached host pages before falling through to recompute, and copy nothing twice."""

from dataclasses import replace

from fake_copy import FakeCopyEngine
from test_prefix_cache import PS, kv_bytes, make_seq, run_to

from kvpark.kernels.kv_copy import SyncCopyEngine
from kvpark.pod.core.reporting import slot_view
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Phase, PreemptMode
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.host_tier import PAGE_BOOKKEEPING_BYTES, HostTier
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.prefix_cache import PrefixCache


def make(num_pages=8, budget_pages=-1, cap_pages=-1, copy_engine=SyncCopyEngine):
    cache = PrefixCache("model", PS)
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=PS, num_kv_heads=1, head_dim=2,
                  cache=cache)
    page_cost = pool.page_bytes + PAGE_BOOKKEEPING_BYTES  # what a host page costs the budget
    host = HostStore(budget_pages if budget_pages < 0 else budget_pages * page_cost)
    copy = copy_engine(pool)
    cap = cap_pages if cap_pages < 0 else cap_pages * page_cost
    pool.tier = HostTier(host, copy, pool.host_page_shape, pool.dtype, cap)
    config = SchedulerConfig(num_slots=3, batch_size=64, preempt_high=1.0, preempt_low=1.0)
    return Scheduler(config, pool, Swapper(pool, host, copy)), pool, pool.tier


def finished_run(scheduler, prompt, num_tokens):
    """A request run to `num_tokens` and finished: its full pages stay cached in the pool."""
    seq = make_seq(prompt)
    scheduler.add(seq)
    run_to(scheduler, seq, num_tokens)
    before = kv_bytes(scheduler.pool, seq, num_tokens)
    scheduler.finish(seq, reason="stop")
    return before


def flush_pool(pool):
    """Someone needs every page: all cached pages are evicted (to the host tier)."""
    taken = pool.allocate(pool.num_free_pages)
    for c in pool.caches:
        c[taken] = -1.0
    pool.free(taken)


def test_an_evicted_prefix_comes_back_from_host_ram_byte_for_byte():
    scheduler, pool, tier = make()
    prompt = list(range(1, 14))  # three full pages and one token of a fourth
    before = finished_run(scheduler, prompt, 13)
    flush_pool(pool)
    assert pool.num_cached_pages == 0 and tier.num_pages == 3 and tier.stats.saves == 3
    again = make_seq(prompt)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 12 and tier.stats.hits == 3  # cached_tokens counts both tiers
    run_to(scheduler, again, 13)
    assert kv_bytes(pool, again, 13) == before
    assert tier.num_pages == 3  # still there after the copy back, for the next one


def test_without_the_tier_an_evicted_prefix_is_computed_again():
    scheduler, pool, tier = make()
    pool.tier = None
    prompt = list(range(1, 14))
    finished_run(scheduler, prompt, 13)
    flush_pool(pool)
    again = make_seq(prompt)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 0 and tier.num_pages == 0


def test_a_swap_park_keeps_its_full_pages_in_the_tier_and_copies_them_once():
    scheduler, pool, tier = make(num_pages=12)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)  # three full pages, two tokens of a fourth
    before = kv_bytes(pool, seq, 14)
    assert scheduler.park(seq) is PreemptMode.SWAP
    assert len(seq.parking.tier_pages) == 3 and seq.parking.host_kv.shape[1] == 1
    assert tier.parked_bytes == 3 * tier.page_bytes and tier.cached_bytes == 0
    # nothing counted twice: three pages in the tier, the tail in the park's own buffer
    assert scheduler.swapper.host.held_bytes == 3 * tier.page_bytes + pool.page_bytes
    flush_pool(pool)  # its released pool pages are evicted: the tier has them, no new copy
    assert tier.stats.saves == 0 and tier.num_pages == 3
    scheduler.resume(seq)
    assert seq.num_computed == 14 and not seq.is_replaying
    assert kv_bytes(pool, seq, 14) == before
    assert seq.parking.restored_from_host == 3 and seq.parking.mode is PreemptMode.SWAP
    assert slot_view(seq).resumed_from == ("host",)  # what /slots shows
    assert tier.parked_bytes == 0 and tier.cached_bytes == 3 * tier.page_bytes
    assert scheduler.swapper.host.held_bytes == 3 * tier.page_bytes  # the tail buffer is gone
    # parked again: the tier has those three pages with its own bytes, none is copied again
    saves = len(tier.stats.save_seconds)
    scheduler.park(seq)
    assert len(tier.stats.save_seconds) == saves and tier.parked_bytes == 3 * tier.page_bytes


def test_a_park_drops_cached_host_pages_before_it_would_recompute():
    scheduler, pool, tier = make(num_pages=8, budget_pages=4)
    finished_run(scheduler, [90 + i for i in range(13)], 13)
    flush_pool(pool)
    assert tier.cached_bytes == 3 * tier.page_bytes  # 3 of the 4-page budget
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)  # needs 3 tier pages + 1 of its own: the budget is 4
    assert scheduler.park(seq) is PreemptMode.SWAP
    assert tier.stats.drops == 3 and scheduler.stats.n_swap_fallbacks == 0
    assert scheduler.swapper.host.held_bytes == 3 * tier.page_bytes + pool.page_bytes


def test_a_park_that_cannot_fit_even_after_dropping_the_cache_recomputes():
    scheduler, pool, tier = make(num_pages=8, budget_pages=3)
    finished_run(scheduler, [90 + i for i in range(13)], 13)
    flush_pool(pool)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    assert scheduler.park(seq) is PreemptMode.RECOMPUTE
    assert tier.cached_bytes == 3 * tier.page_bytes  # nothing dropped for a park that failed


def test_a_recompute_resume_replays_only_what_neither_tier_holds():
    scheduler, pool, tier = make(num_pages=8, budget_pages=2)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    before = kv_bytes(pool, seq, 14)
    assert scheduler.park(seq) is PreemptMode.RECOMPUTE  # 4 pages do not fit a budget of 2
    flush_pool(pool)  # of the three full pages it released, the tier keeps the first two
    scheduler.resume(seq)
    assert seq.num_computed == 8 and seq.parking.replay_until == 14
    assert seq.parking.restored_from_host == 2
    assert slot_view(seq).resumed_from == ("host", "recompute")
    run_to(scheduler, seq, 14)
    assert kv_bytes(pool, seq, 14) == before


def test_the_cache_ram_cap_keeps_the_newest_pages():
    scheduler, pool, tier = make(num_pages=8, cap_pages=2)
    finished_run(scheduler, list(range(1, 14)), 13)
    flush_pool(pool)
    assert tier.num_pages == 2 and tier.cached_bytes == 2 * tier.page_bytes
    assert tier.stats.drops + tier.stats.skipped >= 1


def test_a_swap_never_takes_host_bytes_of_another_computation():
    """The same pages computed twice may differ in bits (CUDA): a swap copies its own."""
    scheduler, pool, tier = make(num_pages=12)
    prompt = list(range(1, 14))
    finished_run(scheduler, prompt, 13)
    flush_pool(pool)
    for page in tier.lookup(pool.cache.grow_hashes([], prompt, 13, 3)):
        page.kv.fill_(-7.0)  # another computation's bits under the same hashes
    seq = make_seq(prompt)
    seq.request = replace(seq.request, params=replace(seq.params, prompt_logprobs=0))  # no cache
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    before = kv_bytes(pool, seq, 14)
    scheduler.park(seq)
    flush_pool(pool)
    scheduler.resume(seq)
    assert seq.parking.restored_from_host == 3 and kv_bytes(pool, seq, 14) == before


def test_cancel_while_a_copy_back_is_in_flight_frees_everything():
    scheduler, pool, tier = make(num_pages=12, copy_engine=FakeCopyEngine)
    copy = scheduler.swapper.copy
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    scheduler.park(seq, wait=False)
    copy.complete(copy.in_flight[0])  # the park's own buffer (the partial page) landed
    scheduler.reap_copies()
    flush_pool(pool)
    scheduler.resume(seq)
    assert copy.in_flight and seq.phase is Phase.PARKED  # its tail is still on its way back
    assert copy.loads  # the tier's pages were copied back (ordered, not in flight)
    scheduler.finish(seq, reason="cancelled")
    copy.complete(copy.in_flight[0])
    scheduler.reap_copies()
    assert pool.num_free_pages == pool.num_pages and not scheduler.swapper.pages_in_flight
    assert tier.parked_bytes == 0
    assert scheduler.swapper.host.held_bytes == tier.cached_bytes == 3 * tier.page_bytes


def test_the_flags_turn_the_tier_on_cap_it_or_off():
    from kvpark.pod.args import parse_args
    from kvpark.pod.serving.stack import make_host_tier

    def tier_for(argv, env=None, budget=-1, prefix_cache=True):
        scheduler, pool, _ = make()
        pool.cache = pool.cache if prefix_cache else None
        host = HostStore(budget)
        return make_host_tier(parse_args(argv, env=env or {}), pool, host,
                              scheduler.swapper.copy)

    assert tier_for([]).cap_bytes == -1  # what parked sequences leave of the one budget
    assert tier_for(["--cache-ram", "64"]).cap_bytes == 64 << 20
    assert tier_for([], env={"LLAMA_ARG_CACHE_RAM": "32"}).cap_bytes == 32 << 20
    assert tier_for(["--cache-ram", "0"]) is None
    assert tier_for(["--no-host-cache"]) is None
    assert tier_for([], budget=0) is None  # --preempt-ram 0 holds nothing
    assert tier_for([], prefix_cache=False) is None
