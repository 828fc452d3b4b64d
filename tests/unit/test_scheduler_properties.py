"""Scheduler, pool and host store under random events (hypothesis), with a fake runner.

After every event: each page is free or in exactly one page table; parked host bytes equal the
sum over swapped sequences and never exceed the budget; a finished sequence holds nothing and
was finished exactly once; and once arrivals stop, everything ends within a bounded number of
steps. With the prefix cache: a page's reference count is the number of its holders (page
tables, copies in flight, cache hits a resume holds), so every reference is released exactly
once; no page is both free and referenced, or cached and referenced; only registered full pages
are shared, and no step writes into a shared page. With the host tier too: host bytes are
cached + parked bytes, each host page counted once however many parked sequences hold it, never
past the budget, and the cached part never past `--cache-ram`.
"""

import itertools
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from page_sets import cached_page_ids, free_page_ids

from kvpark.kernels.kv_copy import SyncCopyEngine
from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Phase, Sequence
from kvpark.pod.core.speculation import SpecConfig
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.host_tier import HostTier
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.paging import pages_for
from kvpark.pod.memory.prefix_cache import PrefixCache
from kvpark.pod.sampling.sampler import ChunkOutput, Sampled, SamplingParams

PAGE_SIZE = 4
NUM_PAGES = 24
EOS = 3


class FakeRunner:
    """Returns token 7 for every row that samples (never EOS), without a model; with a pool,
    checks that no row writes its K/V into a page someone else holds too."""

    def __init__(self, pool: KVPool | None = None) -> None:
        self.pool = pool

    def run(self, plan):
        for item in plan if self.pool is not None else ():
            seq, ps = item.seq, self.pool.page_size
            for pos in range(seq.num_computed, seq.num_computed + item.num_rows):
                page = seq.page_table[pos // ps]
                assert self.pool.ref_count(page) == 1, f"a write into shared page {page}"
        return [ChunkOutput(Sampled(7), verified=verified_sevens(item.draft)) if item.samples
                else ChunkOutput() for item in plan]


def verified_sevens(draft: tuple[int, ...]) -> tuple[Sampled, ...]:
    """What a model that always samples 7 makes of a draft's rows: a 7 from each row after a
    draft token that was 7 (verification stops at the first other one)."""
    accepted = next((i for i, t in enumerate(draft) if t != 7), len(draft))
    return (Sampled(7),) * accepted


def make_engine(budget_pages: int, preempt: bool, preempt_every: int,
                batch_size: int = 8, prefix_cache: bool = False,
                cache_pages: int | None = None, spec: SpecConfig | None = None,
                prefill_first: float = 0.0) -> Engine:
    """With `cache_pages` (-1: no cap of its own) the pool gets a host tier; with
    `prefill_first` the scheduler's clock ticks a tenth of a second a step."""
    cache = PrefixCache("test-model", PAGE_SIZE) if prefix_cache else None
    pool = KVPool(num_layers=1, num_pages=NUM_PAGES, page_size=PAGE_SIZE, num_kv_heads=1,
                  head_dim=2, cache=cache)
    budget = budget_pages if budget_pages < 0 else budget_pages * pool.page_bytes
    host = HostStore(budget)
    if cache_pages is not None:
        cap = cache_pages if cache_pages < 0 else cache_pages * pool.page_bytes
        pool.tier = HostTier(host, SyncCopyEngine(pool), pool.host_page_shape, pool.dtype, cap)
    config = SchedulerConfig(num_slots=3, batch_size=batch_size, preempt=preempt,
                             preempt_every=preempt_every, spec=spec or SpecConfig(),
                             prefill_first=prefill_first)
    scheduler = Scheduler(config, pool, Swapper(pool, host), frozenset({EOS}))
    scheduler.candidates.clock = map(lambda step: step / 10, itertools.count()).__next__
    return Engine(scheduler, FakeRunner(pool if prefix_cache else None))


def make_seq(prompt_len: int, max_tokens: int, finished: dict, token: int = 1) -> Sequence:
    made: list[Sequence] = []

    def sink(event):
        if event.kind == "finished":
            finished[made[0].seq_id] = finished.get(made[0].seq_id, 0) + 1

    made.append(Sequence(Submission(f"r{prompt_len}", (token,) * prompt_len,
                                    SamplingParams(temperature=0, max_tokens=max_tokens), None,
                                    sink), torch.Generator()))
    return made[0]


def check_invariants(engine: Engine, seqs: list[Sequence], finished: dict) -> None:
    s = engine.scheduler
    owned = [p for seq in s.active for p in seq.page_table] + s.swapper.pages_in_flight
    if s.pool.cache is not None:
        check_references(engine)
        owned = list(set(owned))  # shared pages: check_references counts their holders
    assert len(owned) == len(set(owned)), "a page is in two page tables"
    assert not set(owned) & set(free_page_ids(s.pool)), "a page is both free and owned"
    assert len(owned) + s.pool.num_free_pages == s.pool.num_pages, "pages leaked"
    parked_bytes = sum(seq.parking.host_bytes for seq in s.active
                       if seq.parking.host_kv is not None)
    if s.pool.tier is None:
        assert s.swapper.host.held_bytes == parked_bytes
    else:
        check_host_tier(engine)
    if s.swapper.host.budget_bytes >= 0:
        assert s.swapper.host.held_bytes <= s.swapper.host.budget_bytes
    for seq in seqs:
        if seq.is_finished:
            assert finished.get(seq.seq_id) == 1, "finished more than once, or silently"
            assert not seq.page_table and seq.parking.host_kv is None
            assert seq.output.error or seq.finish_reason
        else:
            assert seq.seq_id not in finished
        if seq.phase is Phase.PARKED:
            assert not seq.page_table
        elif seq.phase is Phase.RUNNING and s.speculator.config.enabled:  # drafts' pages gone
            assert len(seq.page_table) <= pages_for(seq.num_computed, s.pool.page_size)


def check_host_tier(engine: Engine) -> None:
    """Host bytes = cached tier pages + tier pages parked sequences hold (once each) + the
    parks' own buffers; the cached part within its cap."""
    s = engine.scheduler
    tier, host = s.pool.tier, s.swapper.host
    held = Counter(id(page) for seq in s.active for page in seq.parking.tier_pages)
    pages = {id(page): page for seq in s.active for page in seq.parking.tier_pages}
    for key, count in held.items():
        assert pages[key].holders == count, "a host page's holders != parked sequences on it"
    own = sum(seq.parking.host_kv.untyped_storage().nbytes() for seq in s.active
              if seq.parking.host_kv is not None)
    assert host.held_bytes == tier.cached_bytes + len(pages) * tier.page_bytes + own
    assert tier.parked_bytes <= len(pages) * tier.page_bytes  # replaced pages are not findable
    if tier.cap_bytes >= 0:
        assert tier.cached_bytes <= tier.cap_bytes


def check_references(engine: Engine) -> None:
    s = engine.scheduler
    pool, cache = s.pool, s.pool.cache
    holders = Counter([p for seq in s.active for p in (*seq.page_table, *seq.parking.held_pages)]
                      + s.swapper.pages_in_flight)
    for page in range(pool.num_pages):
        assert pool.ref_count(page) == holders[page], f"page {page}: references != holders"
    cached, free = set(cached_page_ids(cache)), set(free_page_ids(pool))
    assert not cached & set(holders), "a page is both cached and referenced"
    assert not cached & free, "a page is both cached and free"
    assert len(cached) + len(free) + len(holders) == pool.num_pages, "pages leaked"
    for page, count in holders.items():
        assert count == 1 or cache.is_registered(page), "an unregistered page is shared"
    for seq in s.running:  # shared pages are full pages behind what the sequence writes
        shared = [i for i, p in enumerate(seq.page_table) if pool.ref_count(p) > 1]
        assert all((i + 1) * pool.page_size <= seq.num_computed for i in shared)


event = st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 60), st.integers(1, 40)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("park"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("fail_swap"), st.booleans(), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(event, max_size=60), budget_pages=st.sampled_from([-1, 0, 1, 3, 50]),
       preempt=st.booleans(), preempt_every=st.sampled_from([0, 0, 3]))
def test_invariants_hold_under_random_events(events, budget_pages, preempt, preempt_every):
    run_events(events, budget_pages, preempt, preempt_every)


prefix_event = st.one_of(
    event, st.tuples(st.just("arrive"), st.integers(1, 60), st.integers(1, 40)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(prefix_event, max_size=60),
       budget_pages=st.sampled_from([-1, 0, 1, 3, 50]), preempt=st.booleans(),
       preempt_every=st.sampled_from([0, 0, 3]))
def test_invariants_hold_with_the_prefix_cache(events, budget_pages, preempt, preempt_every):
    """The same events over a pool with a prefix cache: prompts of one repeated token share
    their pages with every earlier one, so sharing, eviction and cached resumes all happen."""
    run_events(events, budget_pages, preempt, preempt_every, prefix_cache=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(prefix_event, max_size=60),
       budget_pages=st.sampled_from([-1, 0, 1, 3, 8, 50]), preempt=st.booleans(),
       preempt_every=st.sampled_from([0, 0, 3]), cache_pages=st.sampled_from([-1, 1, 4]))
def test_invariants_hold_with_the_host_tier(events, budget_pages, preempt, preempt_every,
                                            cache_pages):
    """The same events with evicted pages kept in host RAM under the one budget: parks take
    room from cached host pages, resumes and admissions copy pages back."""
    run_events(events, budget_pages, preempt, preempt_every, prefix_cache=True,
               cache_pages=cache_pages)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(prefix_event, max_size=60),
       budget_pages=st.sampled_from([-1, 0, 3, 50]), preempt=st.booleans(),
       preempt_every=st.sampled_from([0, 3]), prefill_first=st.sampled_from([0.15, 0.5, 3.0]),
       spec=st.booleans())
def test_invariants_hold_with_prompts_first(events, budget_pages, preempt, preempt_every,
                                            prefill_first, spec):
    """The same events with decode rows sitting steps out while prompts wait
    (`--prefill-first`), drafts or not: nothing waits forever, every page comes back."""
    run_events(events, budget_pages, preempt, preempt_every, prefix_cache=True,
               spec=SpecConfig("ngram-simple", draft_max=3) if spec else None,
               prefill_first=prefill_first)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(prefix_event, max_size=60),
       budget_pages=st.sampled_from([-1, 0, 3, 50]), preempt=st.booleans(),
       preempt_every=st.sampled_from([0, 3]), draft_max=st.integers(1, 6))
def test_invariants_hold_with_speculation(events, budget_pages, preempt, preempt_every,
                                          draft_max):
    """The same events with n-gram drafts (every token is 7, so drafts are long and accepted):
    draft pages come and go within a step; between steps a running sequence holds only its
    computed tokens' pages, and no draft row writes a shared page."""
    run_events(events, budget_pages, preempt, preempt_every, prefix_cache=True,
               spec=SpecConfig("ngram-simple", draft_max=draft_max))


def run_events(events, budget_pages, preempt, preempt_every, prefix_cache=False,
               cache_pages=None, spec: SpecConfig | None = None, prefill_first: float = 0.0):
    engine = make_engine(budget_pages, preempt, preempt_every, prefix_cache=prefix_cache,
                         cache_pages=cache_pages, spec=spec, prefill_first=prefill_first)
    s = engine.scheduler
    seqs: list[Sequence] = []
    finished: dict[int, int] = {}
    for kind, a, b in events:
        if kind == "arrive":
            seq = make_seq(a, b, finished, token=1 + len(seqs) % 2 if prefix_cache else 1)
            seqs.append(seq)
            s.add(seq)
        elif kind == "step":
            for _ in range(a):
                engine.step()
        elif kind == "park" and preempt:
            running = s.running
            if running:
                s.park(running[a % len(running)])
        elif kind == "cancel":
            live = [q for q in seqs if not q.is_finished]
            if live:
                s.finish(live[a % len(live)], reason="cancelled")
        elif kind == "fail_swap":
            s.swapper.host.fail_allocations = bool(a)
        check_invariants(engine, seqs, finished)
    # no arrivals any more: everything must end, completed or with an explicit error
    bound = sum(len(q.prompt_ids) + (q.params.max_tokens or 0) for q in seqs) * 4 + 50
    for _ in range(bound):
        if not s.has_work:
            break
        engine.step()
        check_invariants(engine, seqs, finished)
    assert not s.has_work, "a request waits forever"
    cached_on_host = s.pool.tier.cached_bytes if s.pool.tier is not None else 0
    assert s.pool.num_free_pages == NUM_PAGES and s.swapper.host.held_bytes == cached_on_host
    assert s.pool.tier is None or s.pool.tier.parked_bytes == 0
    for seq in seqs:
        assert seq.is_finished
        if seq.output.error is None and seq.finish_reason != "cancelled":
            assert seq.finish_reason == "length"
            assert seq.num_generated == seq.params.max_tokens


def test_overflowing_sequences_are_parked_and_all_finish():
    """A deterministic case of the above: three sequences that need 210 tokens of a 96-token
    pool all finish, through swaps (a 12-page budget holds one victim) and recomputes."""
    engine = make_engine(budget_pages=12, preempt=True, preempt_every=0)
    finished: dict[int, int] = {}
    seqs = [make_seq(30, 40, finished) for _ in range(3)]
    for seq in seqs:
        engine.scheduler.add(seq)
    for _ in range(2000):
        if not engine.scheduler.has_work:
            break
        engine.step()
        check_invariants(engine, seqs, finished)
    stats = engine.scheduler.stats
    assert all(s.finish_reason == "length" and s.num_generated == 40 for s in seqs)
    assert stats.n_preempt_swap > 0 and stats.n_preempt_recompute > 0
    assert stats.n_resume == stats.n_preempt


def parked_pair(order: str):
    """A head parked first whose replay does not fit, and a small one parked after it (budget
    0: both are recomputes, whose need is their whole replay)."""
    pool = KVPool(num_layers=1, num_pages=NUM_PAGES, page_size=PAGE_SIZE, num_kv_heads=1,
                  head_dim=2)
    config = SchedulerConfig(num_slots=3, batch_size=8, resume_order=order,
                             preempt_high=1.0, preempt_low=1.0)
    scheduler = Scheduler(config, pool, Swapper(pool, HostStore(0)))
    finished: dict[int, int] = {}
    runner_seq = make_seq(60, 10, finished)  # holds 15 of 24 pages
    head, small = make_seq(40, 10, finished), make_seq(2, 10, finished)
    for s in (runner_seq, head, small):
        scheduler.add(s)
    scheduler._admit()
    runner_seq.page_table = pool.allocate(15)
    runner_seq.num_computed = 60
    for s, at in ((head, 1.0), (small, 2.0)):
        scheduler.park(s)
        s.parking.parked_at = at
    scheduler._restore_parked()
    return head, small


def test_fair_order_lets_nobody_pass_a_head_that_does_not_fit():
    head, small = parked_pair("fair")
    assert head.is_parked and small.is_parked


def test_spec_order_is_fit_first():
    head, small = parked_pair("spec")
    assert head.is_parked and not small.is_parked


def test_without_preemption_only_one_of_two_blocked_sequences_fails():
    """Both need a page in the same step of a full pool: the later one fails, and the pages it
    gives back let the earlier one go on."""
    # a step budget that takes both prompts at once, so they grow in lockstep
    engine = make_engine(budget_pages=-1, preempt=False, preempt_every=0, batch_size=64)
    finished: dict[int, int] = {}
    first, second = make_seq(32, 40, finished), make_seq(32, 40, finished)
    for seq in (first, second):
        engine.scheduler.add(seq)
    while engine.scheduler.has_work:
        engine.step()
    assert second.output.error == "Context size has been exceeded." and first.output.error is None
    assert first.finish_reason == "length" and first.num_generated == 40
