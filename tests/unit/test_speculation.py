"""Speculative decoding by prompt lookup (`--spec-type ngram-simple`): drafting, exact-match
acceptance, the adaptive pause, page accounting at the pool's edge, cancel and stop mid-draft,
and the property that matters: a sequence's tokens are the same with speculation on and off,
greedy and seeded, with parks forced (swap and recompute).

The engine runs the real `ModelRunner` (row assembly, draft rows, verification and sampling)
over a fake model whose K/V is the token itself, written into the pool and read back: the next
token's logits depend on the previous position's cached token, so a draft row's K/V read after
a rejection, or a park that restored the wrong bytes, changes the output.
"""

from __future__ import annotations

import pytest
import torch

from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import FinishReason, Submission
from kvpark.pod.core.preemption import PREEMPT_N_MARGIN, can_never_fit
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Phase, Sequence
from kvpark.pod.core.speculation import (
    MISSES_TO_PAUSE,
    PAUSE_MIN,
    SpecConfig,
    Speculator,
    find_draft,
)
from kvpark.pod.core.step_plan import ScheduledSeq, add_drafts
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.paging import pages_for
from kvpark.pod.memory.prefix_cache import PrefixCache
from kvpark.pod.sampling.sampler import SamplingParams, make_generator
from kvpark.pod.sampling.verification import verify
from kvpark.pod.worker.runner import ModelRunner

VOCAB = 32
PAGE_SIZE = 4
EOS = 31


# ---- drafting ----------------------------------------------------------------------------------

def test_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 6, 7, 8, 9, 1, 7, 2, 3, 6, 7, 4, 6, 7]
    # suffix (6, 7) occurs at 1..2 and 9..10: the latest one wins; (4, 6, 7) occurs nowhere
    assert find_draft(tokens, 3) == [4, 6, 7]
    # a 3-gram match beats a more recent 1-gram one
    tokens = [1, 2, 3, 9, 9, 5, 3, 8, 1, 2, 3]
    assert find_draft(tokens, 2) == [9, 9]


def test_lookup_falls_back_to_shorter_suffixes_and_is_cut_to_the_draft_length():
    assert find_draft([4, 5, 6, 1, 2, 9, 5], 2) == [6, 1]
    assert find_draft([4, 5, 6, 1, 2, 9, 5], 0) == []


def test_nothing_to_propose_when_the_last_token_never_occurred_before():
    assert find_draft([1, 2, 3, 4], 8) == []
    assert find_draft([7], 8) == []


# ---- acceptance --------------------------------------------------------------------------------

def test_verification_stops_at_the_first_mismatch_and_draws_no_row_after_it():
    drawn: list[int] = []

    def draw(row: int) -> int:
        drawn.append(row)
        return [10, 11, 99, 13, 14][row]

    assert verify([10, 11, 12, 13], draw) == [10, 11, 99]  # 99 is the correction
    assert drawn == [0, 1, 2]  # rows 3 and 4 never touched the generator


def test_a_fully_matched_draft_adds_the_last_rows_token():
    assert verify([4, 5], lambda row: [4, 5, 6][row]) == [4, 5, 6]
    assert verify([], lambda row: 8) == [8]


def test_a_sequence_whose_drafts_keep_failing_pauses_then_drafts_again():
    speculator = Speculator(SpecConfig("ngram-simple", draft_max=4), max_context=1000)
    seq = make_seq([3, 4, 3, 4, 3], SamplingParams(temperature=0))
    seq.tokens.append(4)  # one generated token, pending
    seq.num_computed = len(seq.tokens) - 1
    assert speculator.propose(seq, room=8) == (3, 4)  # what followed (4, 3, 4) at 1..3
    for _ in range(MISSES_TO_PAUSE):
        speculator.settle(seq, drafted=4, accepted=0)
    assert speculator.propose(seq, room=8) == ()  # paused
    seq.tokens.extend([3] * PAUSE_MIN)
    seq.num_computed = len(seq.tokens) - 1
    assert speculator.propose(seq, room=8) != ()  # the pause is over
    for _ in range(MISSES_TO_PAUSE):
        speculator.settle(seq, drafted=4, accepted=0)
    assert seq.spec.pause == 2 * PAUSE_MIN  # a second pause in a row lasts twice as long
    speculator.settle(seq, drafted=4, accepted=2)
    assert seq.spec.pause == 2 * PAUSE_MIN and seq.spec.misses == 0  # a partial match
    speculator.settle(seq, drafted=1, accepted=1)
    assert seq.spec.pause == 2 * PAUSE_MIN  # one lucky token (free text) keeps the pausing
    speculator.settle(seq, drafted=3, accepted=3)
    assert seq.spec.pause == 0  # a full match: the next failures pause from the start again
    assert (seq.spec.num_drafted, seq.spec.num_accepted) == (24, 6)
    assert speculator.stats.num_accepted_tokens == 6


def test_the_next_draft_is_one_past_the_accepted_run_and_full_after_a_full_match():
    speculator = Speculator(SpecConfig("ngram-simple", draft_max=6), max_context=1000)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], SamplingParams(temperature=0))
    seq.tokens.append(3)
    seq.num_computed = len(seq.tokens) - 1
    assert speculator.propose(seq, room=16) == (4, 5, 6, 7, 8, 9)
    speculator.settle(seq, drafted=6, accepted=2)
    assert speculator.propose(seq, room=16) == (4, 5, 6)  # 2 matched: guess 3 next time
    speculator.settle(seq, drafted=3, accepted=0)
    assert speculator.propose(seq, room=16) == (4,)  # a failed guess costs one row next time
    speculator.settle(seq, drafted=1, accepted=1)
    assert speculator.propose(seq, room=16) == (4, 5)  # all matched: twice as long
    speculator.settle(seq, drafted=2, accepted=2)
    speculator.settle(seq, drafted=4, accepted=4)
    assert speculator.propose(seq, room=16) == (4, 5, 6, 7, 8, 9)  # up to n-max
    at_least_two = Speculator(SpecConfig("ngram-simple", draft_max=6, draft_min=2), 1000)
    at_least_two.settle(seq, drafted=3, accepted=0)
    assert at_least_two.propose(seq, room=16) == (4, 5)  # n-min bounds the shrinking
    assert at_least_two.propose(seq, room=1) == ()  # and refuses what is shorter


def test_no_drafts_for_grammars_logprobs_penalties_or_past_max_tokens():
    speculator = Speculator(SpecConfig("ngram-simple", draft_max=4), max_context=1000)
    for params in (SamplingParams(logprobs=1), SamplingParams(repeat_penalty=1.1),
                   SamplingParams(max_tokens=1)):
        seq = make_seq([3, 4, 3, 4, 3], params)
        seq.tokens.append(4)
        seq.num_computed = len(seq.tokens) - 1
        assert speculator.propose(seq, room=8) == ()
    seq = make_seq([3, 4, 3, 4, 3], SamplingParams(max_tokens=3))
    seq.tokens.append(4)
    seq.num_computed = len(seq.tokens) - 1
    assert speculator.propose(seq, room=8) == (3,)  # 2 tokens left: 1 drafted + 1 sampled
    assert Speculator(SpecConfig("none"), 1000).propose(seq, room=8) == ()


# ---- page accounting ---------------------------------------------------------------------------

def test_drafts_take_only_free_pages_and_are_cut_at_the_pools_edge():
    speculator = Speculator(SpecConfig("ngram-simple", draft_max=16), max_context=1000)
    seq = make_seq([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0))
    seq.tokens.append(3)
    seq.page_table, seq.num_computed = [0, 1], 8  # 8 computed tokens fill two pages
    plan = [ScheduledSeq(seq, 1)]
    # one unused page: the last token and 3 draft rows fill it exactly
    drafted = add_drafts(plan, speculator, 64, 1, PAGE_SIZE)
    assert drafted[0].draft == (1, 2, 3) and drafted[0].new_pages(PAGE_SIZE) == 1
    # the page the last token needs anyway came from the cache: drafts only fill its slack
    drafted = add_drafts(plan, speculator, 64, 0, PAGE_SIZE)
    assert drafted[0].draft == (1, 2, 3) and drafted[0].new_pages(PAGE_SIZE) == 1
    # the token budget counts draft rows, and so does the cap on a step's rows
    assert add_drafts(plan, speculator, 2, 1, PAGE_SIZE)[0].draft == (1,)
    capped = Speculator(SpecConfig("ngram-simple", draft_max=16, max_step_rows=3), 1000)
    assert add_drafts(plan, capped, 64, 1, PAGE_SIZE)[0].draft == (1, 2)
    # at the pool's edge: the last token fills the last page, nothing is unused: no draft
    seq.tokens[-1:] = [3, 1, 2, 3]
    seq.page_table, seq.num_computed = [0, 1, 2], 11
    assert add_drafts(plan, speculator, 64, 0, PAGE_SIZE)[0].draft == ()
    assert add_drafts(plan, speculator, 64, 1, PAGE_SIZE)[0].draft == (1, 2, 3)


def test_a_parked_sequence_within_margin_plus_draft_length_of_the_pool_can_never_fit():
    capacity, n_spec = 64, 8
    seq = make_seq([1] * (capacity - PREEMPT_N_MARGIN - n_spec), SamplingParams())
    assert can_never_fit(seq, capacity, n_spec)
    assert not can_never_fit(seq, capacity)  # without drafts it still had room
    seq = make_seq([1] * (capacity - PREEMPT_N_MARGIN - n_spec - 1), SamplingParams())
    assert not can_never_fit(seq, capacity, n_spec)


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("ngram-simple", draft_max=3)])
def test_the_scheduler_ends_a_parked_sequence_within_the_reserve_that_counts_drafts(spec):
    engine = make_engine(spec, num_pages=16, budget=0)  # 64 cells, parks recompute
    capacity = 16 * PAGE_SIZE
    seq = make_seq([1] * (capacity - PREEMPT_N_MARGIN - 1 - 3), SamplingParams(max_tokens=2))
    engine.scheduler.add(seq)
    engine.step()  # the prompt, and the first token: 53 tokens
    engine.scheduler.park(seq)
    engine.step()
    if spec.enabled:  # 53 + 8 + 1 + 3 cells > 64: it can never run again with its drafts
        assert seq.finish_reason is FinishReason.CONTEXT_EXCEEDED
    else:
        assert seq.phase is not Phase.PARKED and not seq.failed


def test_drafted_steps_hold_between_steps_only_the_pages_of_computed_tokens():
    engine = make_engine(SpecConfig("ngram-simple", draft_max=6), num_pages=64)
    seq = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=40))
    engine.scheduler.add(seq)
    drafted = 0
    while engine.step():
        drafted += bool(engine.runner.last_drafts)
        if not seq.is_finished:
            assert len(seq.page_table) == pages_for(seq.num_computed, PAGE_SIZE)
    assert drafted and seq.finish_reason is FinishReason.LENGTH
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_pages


def test_with_a_prefix_cache_only_pages_full_of_accepted_tokens_are_registered():
    cache = PrefixCache("test", PAGE_SIZE)
    engine = make_engine(SpecConfig("ngram-simple", draft_max=6), num_pages=64, cache=cache)
    seq = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=30))
    engine.scheduler.add(seq)
    while engine.step():
        pass
    # every registered page holds the K/V (here: the tokens) of the sequence's own tokens
    caches = engine.scheduler.pool.caches[0]
    full = len(seq.page_hashes)
    assert full == len(seq.tokens[:-1]) // PAGE_SIZE
    for i, h in enumerate(seq.page_hashes):
        page = cache.find(h)
        stored = caches[page, 0, :, 0, 0].long().tolist()
        assert stored == seq.tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]


# ---- the engine: same tokens on and off --------------------------------------------------------

COPY_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("park", ["none", "swap", "recompute"])
def test_tokens_are_the_same_with_speculation_on_and_off(temperature, park):
    prompts = [COPY_PROMPT, [3, 9, 27, 17, 19, 25, 11, 1, 3, 9], [5] * 7]
    runs = {}
    for spec in (SpecConfig(), SpecConfig("ngram-simple", draft_max=5)):
        engine = make_engine(spec, num_pages=64, preempt_every=0 if park == "none" else 7,
                             budget=0 if park == "recompute" else -1)
        seqs = [make_seq(p, SamplingParams(temperature=temperature, seed=11 + i, max_tokens=60),
                         seed=11 + i) for i, p in enumerate(prompts)]
        for seq in seqs:
            engine.scheduler.add(seq)
        steps = run_to_the_end(engine)
        assert all(s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for s in seqs)
        runs[spec.enabled] = ([s.generated_ids for s in seqs], steps, engine)
    assert runs[True][0] == runs[False][0]
    stats = runs[True][2].scheduler.speculator.stats
    assert stats.num_accepted_tokens > 0  # the drafts were real, and some were accepted
    if temperature == 0:  # every prompt here falls into a cycle the lookup then predicts
        assert runs[True][1] < runs[False][1]
    if park != "none":
        assert runs[True][2].scheduler.stats.n_preempt > 0


def test_metrics_and_timings_count_drafted_and_accepted_tokens():
    from kvpark.pod.core.reporting import result_of
    from kvpark.pod.http.formats.results import timings
    from kvpark.pod.metrics.prometheus import Metrics

    engine = make_engine(SpecConfig("ngram-simple", draft_max=6), num_pages=64)
    swapper = engine.scheduler.swapper
    metrics = Metrics(engine.scheduler, swapper.host, swapper.copy_times, model_name="kv-test")
    seq = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=40))
    plain = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    engine.scheduler.add(seq)
    engine.scheduler.add(plain)
    run_to_the_end(engine)
    values = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    label = '{model_name="kv-test"}'
    for name, expected in (("num_drafts", seq.spec.num_drafts),
                           ("num_draft_tokens", seq.spec.num_drafted),
                           ("num_accepted_tokens", seq.spec.num_accepted)):
        assert values[f"kvpark:spec_decode_{name}_total"] == expected > 0
        assert values[f"vllm:spec_decode_{name}_total{label}"] == expected
    assert timings(result_of(seq))["draft_n"] == seq.spec.num_drafted
    assert timings(result_of(seq))["draft_n_accepted"] == seq.spec.num_accepted
    assert "draft_n" not in timings(result_of(plain))  # logprobs requests: never drafted


def test_a_stop_mid_draft_ends_there_and_frees_every_page():
    """EOS sampled at a draft row: the tokens after it are never emitted (as plain decoding
    never samples them), and the sequence gives everything back."""
    engine = make_engine(SpecConfig("ngram-simple", draft_max=6), num_pages=64)
    plain = make_engine(SpecConfig(), num_pages=64)
    prompt = eos_prompt()
    outs = []
    for e in (engine, plain):
        seq = make_seq(prompt, SamplingParams(temperature=0, max_tokens=50))
        e.scheduler.add(seq)
        while e.step():
            pass
        outs.append(seq)
        assert seq.finish_reason is FinishReason.STOP
        assert e.scheduler.pool.num_free_pages == e.scheduler.pool.num_pages
    assert outs[0].generated_ids == outs[1].generated_ids
    assert engine.runner.eos_mid_draft  # EOS was accepted with draft rows after it
    assert outs[0].generated_ids[-1] == EOS


def test_a_cancel_during_verification_frees_every_page():
    """The model runs without the engine's lock: a cancel that arrives meanwhile is handed over
    before the next step, after the verified tokens were taken, and ends the sequence with no
    page left behind (draft pages included)."""
    engine = make_engine(SpecConfig("ngram-simple", draft_max=6), num_pages=64)
    seq = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=200))
    engine.scheduler.add(seq)
    engine.runner.on_drafted = lambda: engine.cancel([seq.request_id])  # inside the model's run
    while not engine.runner.last_drafts:
        engine.step()
    assert seq.phase is Phase.RUNNING  # the verification was taken; the cancel is queued
    with engine.lock, engine._cond:
        engine._take_input()
    assert seq.finish_reason is FinishReason.CANCELLED
    assert not seq.page_table
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_pages


# ---- the fake model ----------------------------------------------------------------------------

class TokenKV:
    """A model whose K/V at a position is that position's token, in the real pool's pages.
    Row r's logits: a strong peak at f(previous token as cached, token), a weaker one next to
    it: a Markov chain that soon repeats itself, so prompt lookup finds its continuations."""

    has_blocks = False
    device = torch.device("cpu")

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.layout = None

    def __call__(self, ids, positions, backend, caches, rows):
        layout = backend.layout
        cache = caches[0]  # [pages, 2, page_size, 1, 1]
        ps = layout.page_size
        at = 0
        for table, kv_len, q_len in zip(layout.page_tables, layout.kv_lens, layout.q_lens):
            for i in range(q_len):  # write every fed row first (K/V of this step)
                p = kv_len - q_len + i
                cache[table[p // ps], 0, p % ps, 0, 0] = float(ids[at + i])
            at += q_len
        prev = []
        for table, kv_len, q_len in zip(layout.page_tables, layout.kv_lens, layout.q_lens):
            for i in range(q_len):  # then read what the previous position holds
                p = kv_len - q_len + i - 1
                prev.append(int(cache[table[p // ps], 0, p % ps, 0, 0]) if p >= 0 else 0)
        return torch.stack([ids.float(), torch.tensor(prev, dtype=torch.float)], dim=1)

    def logits(self, hidden, rows=None):
        out = torch.zeros(hidden.shape[0], VOCAB)
        for r, (cur, prev) in enumerate(hidden.long().tolist()):
            out[r, (3 * prev + 5 * cur + 1) % VOCAB] = 6.0
            out[r, (cur + 1) % VOCAB] += 2.0
        return out


class FakeBackend:
    name = "fake"

    def plan(self, layout):
        self.layout = layout


class RecordingRunner(ModelRunner):
    """The real runner; it notes the drafts of each step (and may act while the model runs)."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(TokenKV(pool), pool, FakeBackend())
        self.last_drafts: list[tuple[int, ...]] = []
        self.on_drafted = lambda: None
        self.eos_mid_draft = False

    def run(self, plan):
        # a draft model's drafts are made inside the run: their length stands for them here
        self.last_drafts = [item.draft or (None,) * item.draft_room for item in plan
                            if item.num_rows > item.num_tokens]
        if self.last_drafts:
            self.on_drafted()
        outputs = super().run(plan)
        for out in outputs:
            emitted = [out.sampled, *out.verified] if out.sampled else []
            if any(s.token == EOS for s in emitted[:-1]):  # rows were verified after EOS
                self.eos_mid_draft = True
        return outputs


def run_to_the_end(engine: Engine) -> int:
    """Step until nothing is left (a step may run nothing while every sequence is parked:
    the next one restores them); returns the steps that ran the model."""
    steps = 0
    for _ in range(10_000):
        if not engine.scheduler.has_work:
            return steps
        steps += engine.step()
    raise AssertionError("the engine never finished")


def make_engine(spec: SpecConfig, num_pages: int, preempt_every: int = 0, budget: int = -1,
                cache: PrefixCache | None = None) -> Engine:
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=1,
                  head_dim=1, cache=cache)
    config = SchedulerConfig(num_slots=3, batch_size=64, preempt_every=preempt_every,
                             spec=spec, max_context=num_pages * PAGE_SIZE)
    return Engine(Scheduler(config, pool, Swapper(pool, HostStore(budget)), frozenset({EOS})),
                  RecordingRunner(pool))


def make_seq(prompt: list[int], params: SamplingParams, seed: int | None = 0) -> Sequence:
    return Sequence(Submission("r", tuple(prompt), params, seed, lambda *a: None),
                    make_generator(seed))


def eos_prompt() -> list[int]:
    """A prompt that holds the fake model's greedy path from its first two tokens to EOS, then
    those two tokens again: the continuation repeats the path, drafted with EOS inside."""
    for first in range(VOCAB):
        for second in range(VOCAB):
            prev, cur, path = first, second, []
            for _ in range(8):
                prev, cur = cur, (3 * prev + 5 * cur + 1) % VOCAB
                path.append(cur)
                if cur == EOS:
                    break
            if 4 <= len(path) <= 7 and path[-1] == EOS and EOS not in (first, second):
                return [first, second, *path, first, second]
    raise AssertionError("no prompt reaches EOS")
