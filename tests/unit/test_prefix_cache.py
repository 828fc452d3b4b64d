"""The prefix cache: chained page hashes, reference counts and the LRU of cached pages; cached
prompt prefixes at admission; eviction before any park; parks restored from the cache."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpark.pod.core.messages import Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Phase, PreemptMode, Sequence
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.prefix_cache import PrefixCache, chain_hash, seed_hash
from kvpark.pod.sampling.sampler import SamplingParams

PS = 4


def make_seq(prompt: list[int], n: int = 1, index: int = 0) -> Sequence:
    return Sequence(Submission(f"r{index}", tuple(prompt), SamplingParams(temperature=0), None,
                               lambda *a: None, index=index, family_size=n),
                    torch.Generator())


def make(num_pages=16, budget=-1, split_kinds=False):
    cache = PrefixCache("model", PS, split_kinds=split_kinds)
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=PS, num_kv_heads=1, head_dim=2,
                  cache=cache)
    config = SchedulerConfig(num_slots=3, batch_size=64, preempt_high=1.0, preempt_low=1.0)
    return Scheduler(config, pool, Swapper(pool, HostStore(budget))), pool, cache


def run_to(scheduler: Scheduler, seq: Sequence, num_tokens: int) -> None:
    """Step (without a model) until `seq` has `num_tokens` tokens computed, writing into each
    K/V slot a value that names its token and position."""
    while seq.num_computed < num_tokens:
        for item in scheduler.schedule():
            s = item.seq
            for pos in range(s.num_computed, s.num_computed + item.num_tokens):
                for cache in scheduler.pool.caches:
                    cache[s.page_table[pos // PS], :, pos % PS] = s.tokens[pos] * 1000 + pos
            scheduler.advance(item, 7 if item.samples else None, item.seq.num_complete)


def kv_bytes(pool: KVPool, seq: Sequence, num_tokens: int) -> bytes:
    """The K/V bytes of its first `num_tokens` positions, every layer."""
    return b"".join(c[seq.page_table[pos // PS], :, pos % PS].numpy().tobytes()
                    for c in pool.caches for pos in range(num_tokens))


# ---- hashes ------------------------------------------------------------------------------------
def test_a_page_hash_depends_on_everything_before_it():
    seed = seed_hash("model-a")
    a = chain_hash(seed, [1, 2, 3, 4], None)
    assert chain_hash(seed, [1, 2, 3, 4], None) == a
    assert chain_hash(seed_hash("model-b"), [1, 2, 3, 4], None) != a  # other weights
    assert chain_hash(chain_hash(seed, [9, 9, 9, 9], None), [1, 2, 3, 4], None) != a
    assert chain_hash(seed, [1, 2, 3, 4], 4) != chain_hash(seed, [1, 2, 3, 4], 2)


def hashes_of(cache: PrefixCache, seq: Sequence, num_full_pages: int) -> list[bytes]:
    return cache.grow_hashes([], seq.tokens, seq.num_prompt, num_full_pages)


@given(tokens=st.lists(st.integers(0, 3), min_size=4, max_size=40),
       other=st.lists(st.integers(0, 3), min_size=4, max_size=40))
def test_lookup_finds_exactly_the_longest_shared_whole_page_prefix(tokens, other):
    cache = PrefixCache("m", PS)
    a, b = make_seq(tokens), make_seq(other)
    for page, h in enumerate(hashes_of(cache, a, len(tokens) // PS)):
        cache.register(page, h)
    found = cache.lookup(hashes_of(cache, b, len(other) // PS))
    common = 0
    while (common + 1) * PS <= min(len(tokens), len(other)) and \
            tokens[:(common + 1) * PS] == other[:(common + 1) * PS]:
        common += 1
    assert found == list(range(common))


def test_split_kinds_keeps_decoded_pages_apart_from_prompt_pages():
    """Where decode rows read other weights, a page decoded by one request is not a prompt
    page for the next, though the tokens are the same."""
    first = make_seq([5, 6])
    first.tokens += [7, 8]  # two generated tokens fill the page
    second = make_seq([5, 6, 7, 8, 9])
    split, plain = PrefixCache("m", PS, split_kinds=True), PrefixCache("m", PS)
    assert hashes_of(split, first, 1) != hashes_of(split, second, 1)
    assert hashes_of(plain, first, 1) == hashes_of(plain, second, 1)


# ---- the pool's references -------------------------------------------------------------------
def test_released_registered_pages_stay_cached_and_are_evicted_last_used_first():
    cache = PrefixCache("m", PS)
    pool = KVPool(num_layers=1, num_pages=4, page_size=PS, num_kv_heads=1, head_dim=2,
                  cache=cache)
    pages = pool.allocate(3)
    for page in pages:
        cache.register(page, bytes([page]))
    pool.share(pages[:1])
    pool.free(pages)  # page 0 still held once; pages 1, 2 cached, the last one first in line
    assert pool.ref_count(pages[0]) == 1 and pool.num_cached_pages == 2
    assert pool.num_free_pages == 3 and pool.num_used_pages == 1
    assert pool.allocate(1) == [3]  # a free page before any cached one
    assert pool.allocate(1) == [pages[2]] and cache.stats.evictions == 1
    assert cache.lookup([bytes([0]), bytes([1]), bytes([2])]) == [pages[0], pages[1]]
    pool.share([pages[1]])  # a hit takes it out of the LRU
    assert pool.num_cached_pages == 0 and not pool.can_allocate(1)


# ---- admission ---------------------------------------------------------------------------------
def test_a_repeated_prompt_computes_only_its_last_page():
    scheduler, pool, cache = make()
    first = make_seq(list(range(10, 22)))  # 12 tokens: three full pages
    scheduler.add(first)
    run_to(scheduler, first, 13)
    scheduler.finish(first, reason="stop")
    assert pool.num_cached_pages == 3 and pool.num_used_pages == 0
    again = make_seq(list(range(10, 22)) + [99])
    scheduler.add(again)
    plan = scheduler.schedule()
    assert again.num_cached == 12 and plan[0].num_tokens == 1  # only the new token is fed
    assert cache.stats.hits == 12 and cache.stats.queries == 12 + 13
    same = make_seq(list(range(10, 22)))  # a whole-page hit still computes one page
    scheduler.add(same)
    scheduler.schedule()
    assert same.num_cached == 8


def test_n_siblings_share_the_prompt_pages():
    scheduler, pool, _ = make()
    family = [make_seq(list(range(40, 49)), n=3, index=i) for i in range(3)]
    for seq in family:
        scheduler.add(seq)
    scheduler.schedule()
    assert [s.phase for s in family] == [Phase.RUNNING, Phase.WAITING, Phase.WAITING]
    run_to(scheduler, family[0], 9)  # the first computes the prompt, then the others join
    run_to(scheduler, family[2], 9)
    assert all(s.num_cached == 8 for s in family[1:])
    assert family[1].page_table[:2] == family[2].page_table[:2] == family[0].page_table[:2]
    assert pool.ref_count(family[0].page_table[0]) == 3


def test_cached_pages_are_evicted_before_anyone_is_parked():
    scheduler, pool, cache = make(num_pages=8)
    for base in (100, 200):
        done = make_seq([base + i for i in range(12)])
        scheduler.add(done)
        run_to(scheduler, done, 13)
        scheduler.finish(done, reason="stop")
    assert pool.num_cached_pages == 6 and pool.num_used_pages == 0
    a, b = make_seq([1] * 12), make_seq([2] * 12)
    for seq in (a, b):
        scheduler.add(seq)
    run_to(scheduler, a, 16)
    assert scheduler.stats.n_preempt == 0 and cache.stats.evictions >= 4
    assert a.phase is b.phase is Phase.RUNNING


# ---- parks -----------------------------------------------------------------------------------
def test_a_swap_park_comes_back_from_the_cache_without_a_replay():
    scheduler, pool, _ = make()
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)  # three full pages and two tokens of a fourth
    before = kv_bytes(pool, seq, 14)
    full = seq.page_table[:3]
    assert scheduler.park(seq) is PreemptMode.SWAP
    assert pool.num_cached_pages == 3 and pool.num_used_pages == 0
    seq.parking.host_kv[:, :3] = -1.0  # the full pages must come from the cache, not the host
    scheduler.resume(seq)
    assert seq.page_table[:3] == full and seq.num_computed == 14 and not seq.is_replaying
    assert kv_bytes(pool, seq, 14) == before
    assert seq.parking.mode is PreemptMode.CACHED
    assert scheduler.stats.n_preempt_cached == 1 and scheduler.stats.n_recompute_tokens == 0
    assert scheduler.swapper.host.held_bytes == 0


def test_a_swap_park_copies_back_what_the_cache_lost():
    scheduler, pool, cache = make(num_pages=8)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    before = kv_bytes(pool, seq, 14)
    scheduler.park(seq)
    taken = pool.allocate(8)  # someone needs the whole pool: every cached page is evicted
    for c in pool.caches:
        c[taken] = -1.0
    pool.free(taken)
    scheduler.resume(seq)
    assert kv_bytes(pool, seq, 14) == before and seq.num_computed == 14
    assert not seq.is_replaying and cache.stats.evictions == 3
    assert seq.parking.mode is PreemptMode.SWAP and scheduler.stats.n_preempt_cached == 0


def test_a_recompute_park_replays_only_what_the_cache_lost():
    scheduler, pool, _ = make(budget=0)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    before = kv_bytes(pool, seq, 14)
    assert scheduler.park(seq) is PreemptMode.RECOMPUTE
    scheduler.resume(seq)
    assert seq.num_computed == 12 and seq.parking.replay_until == 14  # the partial page only
    assert scheduler.stats.n_recompute_tokens == 2
    run_to(scheduler, seq, 14)
    assert kv_bytes(pool, seq, 14) == before


def test_a_recompute_park_on_a_page_boundary_replays_nothing():
    scheduler, pool, _ = make(budget=0)
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 12)
    scheduler.park(seq)
    scheduler.resume(seq)
    assert seq.num_computed == 12 and not seq.is_replaying
    assert seq.parking.mode is PreemptMode.CACHED and scheduler.stats.n_recompute_tokens == 0


def shared_pair(budget=-1, num_pages=16):
    """Two sequences whose prompts share two full pages, both run past their prompts."""
    scheduler, pool, cache = make(num_pages=num_pages, budget=budget)
    first = make_seq(list(range(1, 11)))
    scheduler.add(first)
    run_to(scheduler, first, 11)
    second = make_seq([*range(1, 9), 50, 51], index=1)
    scheduler.add(second)
    run_to(scheduler, second, 14)
    assert second.page_table[:2] == first.page_table[:2]
    return scheduler, pool, first, second


def test_a_swap_park_copies_only_the_pages_nobody_else_holds():
    scheduler, pool, first, second = shared_pair()
    before = kv_bytes(pool, second, 14)
    assert scheduler.park(second) is PreemptMode.SWAP
    host = scheduler.swapper.host
    assert second.parking.resident_pages == 2
    assert second.parking.host_kv.shape[1] == 2  # its third (full) and fourth (partial) page
    assert host.held_bytes == pool.swap_bytes(2)
    scheduler.resume(second)
    assert second.page_table[:2] == first.page_table[:2] and second.num_computed == 14
    assert kv_bytes(pool, second, 14) == before and not second.is_replaying
    assert host.held_bytes == 0


def test_a_resident_page_lost_while_parked_is_replayed_not_copied():
    scheduler, pool, first, second = shared_pair(num_pages=8)
    before = kv_bytes(pool, second, 14)
    scheduler.park(second)
    scheduler.finish(first, reason="stop")  # the shared pages are cached now, then evicted
    taken = pool.allocate(pool.num_free_pages)
    pool.free(taken)
    scheduler.resume(second)
    assert second.num_computed == 0 and second.parking.replay_until == 14
    assert scheduler.swapper.host.held_bytes == 0 and second.parking.host_kv is None
    run_to(scheduler, second, 14)
    assert kv_bytes(pool, second, 14) == before
