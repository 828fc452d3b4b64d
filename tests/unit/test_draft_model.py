"""Speculative decoding with a draft model (`--model-draft`, `--spec-type draft-simple`): the
draft's K/V live in the pool's last layer, beside the target's, and travel with them.

The target and the draft are `TokenKV` models (test_speculation.py): a position's K/V is its
token, written into the real pool's pages; a row's next token depends on the token its model
finds cached at the previous position. A draft with the target's rule therefore proposes
exactly what the target samples *only while its own K/V are right*: lost by a swap, left stale
by a recompute, missing after a lag or wrong in a prefix-cache page, and a draft is rejected.
So "every drafted token accepted" tests the draft's K/V across parks and the prefix cache, and
the tokens must still be those of plain decoding whatever the draft says.
"""

from __future__ import annotations

import pytest
import torch
from test_speculation import (
    COPY_PROMPT,
    EOS,
    PAGE_SIZE,
    FakeBackend,
    RecordingRunner,
    TokenKV,
    make_seq,
    run_to_the_end,
)

from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import FinishReason
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Phase
from kvpark.pod.core.speculation import SpecConfig, Speculator
from kvpark.pod.core.step_plan import ScheduledSeq, add_drafts
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.paging import pages_for
from kvpark.pod.memory.prefix_cache import PrefixCache
from kvpark.pod.model.synthetic import synthetic_config
from kvpark.pod.sampling.sampler import SamplingParams
from kvpark.pod.worker.draft_model import Drafter, check_draft

PROMPTS = [COPY_PROMPT, [3, 9, 27, 17, 19, 25, 11, 1, 3, 9], [5] * 7]


class CheckingDrafter(Drafter):
    """The real drafter; before each step it notes every position its rows will attend to
    (what the draft already computed) whose K/V differ from the target's layer: the draft's
    K/V must be the target's there after any park, resume, lag or cache hit (both models
    write the token itself)."""

    def __init__(self, pool: KVPool, model: TokenKV) -> None:
        super().__init__(model, FakeBackend(), pool.caches[1:], PAGE_SIZE)
        self.pool = pool
        self.wrong: list[int] = []
        self.checked = 0

    def fill(self, plan):
        target, draft = self.pool.caches[0], self.pool.caches[1]
        for item in plan:
            seq = item.seq
            for p in range(seq.num_computed - seq.spec.draft_lag):
                page, at = seq.page_table[p // PAGE_SIZE], p % PAGE_SIZE
                self.checked += 1
                if not torch.equal(target[page, :, at], draft[page, :, at]):
                    self.wrong.append(p)
        return super().fill(plan)


class Disagreeing(TokenKV):
    """A draft that follows the target's rule except where the current token is a multiple of
    3: there it proposes the token after its peak."""

    def logits(self, hidden, rows=None):
        out = super().logits(hidden, rows)
        for r, (cur, _) in enumerate(hidden.long().tolist()):
            if cur % 3 == 0:
                out[r] = torch.roll(out[r], 1)
        return out


def make_engine(spec: SpecConfig, num_pages: int = 64, draft=TokenKV, preempt_every: int = 0,
                budget: int = -1, cache: PrefixCache | None = None) -> Engine:
    """The target's K/V in layer 0, the draft's in layer 1 (a pool of two layers either way:
    plain decoding leaves layer 1 alone)."""
    pool = KVPool(num_layers=2, num_pages=num_pages, page_size=PAGE_SIZE, num_kv_heads=1,
                  head_dim=1, cache=cache)
    config = SchedulerConfig(num_slots=3, batch_size=64, preempt_every=preempt_every,
                             spec=spec, max_context=num_pages * PAGE_SIZE)
    runner = RecordingRunner(pool)
    if spec.uses_model:
        runner.drafter = CheckingDrafter(pool, draft(pool))
    return Engine(Scheduler(config, pool, Swapper(pool, HostStore(budget)), frozenset({EOS})),
                  runner)


DRAFT = SpecConfig("draft-simple", draft_max=4)
PARKS = {"none": {}, "swap": {"preempt_every": 7}, "recompute": {"preempt_every": 7, "budget": 0}}


def run(engine: Engine, prompts: list[list[int]], temperature: float = 0.0,
        max_tokens: int = 40) -> list[list[int]]:
    seqs = [make_seq(p, SamplingParams(temperature=temperature, seed=11 + i,
                                       max_tokens=max_tokens), seed=11 + i)
            for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.scheduler.add(seq)
    run_to_the_end(engine)
    assert all(s.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for s in seqs)
    return [s.generated_ids for s in seqs]


@pytest.mark.parametrize("park", PARKS)
def test_a_draft_with_the_targets_rule_has_every_token_accepted_across_parks_and_the_cache(
        park):
    cache = PrefixCache("test", PAGE_SIZE)
    engine = make_engine(DRAFT, cache=cache, **PARKS[park])
    plain = make_engine(SpecConfig(), **PARKS[park])
    # the third prompt starts with the first's two pages: admitted after the first ended, it
    # finds them cached, draft K/V included
    later = [COPY_PROMPT[:9] + [30, 29]]
    assert run(engine, PROMPTS) == run(plain, PROMPTS)
    assert run(engine, later) == run(plain, later)
    stats = engine.scheduler.speculator.stats
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert cache.stats.hits >= 2 * PAGE_SIZE
    drafter = engine.runner.drafter
    assert drafter.checked > 500 and drafter.wrong == []
    if park != "none":
        assert engine.scheduler.stats.n_preempt > 0
        mode = engine.scheduler.stats
        assert (mode.n_preempt_swap if park == "swap" else mode.n_preempt_recompute) > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("park", PARKS)
def test_tokens_are_those_of_plain_decoding_whatever_the_draft_proposes(temperature, park):
    engine = make_engine(DRAFT, draft=Disagreeing, **PARKS[park])
    plain = make_engine(SpecConfig(), **PARKS[park])
    assert run(engine, PROMPTS, temperature, 60) == run(plain, PROMPTS, temperature, 60)
    stats = engine.scheduler.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("draft", ["TokenKV", "AlwaysWrong"])
def test_a_page_is_registered_only_once_both_models_wrote_its_kv(draft):
    """After a fully accepted draft the draft model has not fed its last token yet (its next
    pass does), and during a pause it feeds nothing: the pages those tokens complete wait."""
    cache = PrefixCache("test", PAGE_SIZE)
    engine = make_engine(DRAFT, draft=globals()[draft], cache=cache)
    seq = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=41))
    engine.scheduler.add(seq)
    pool = engine.scheduler.pool
    lagged = 0
    while engine.step():
        lagged = max(lagged, seq.spec.draft_lag)
        for h in seq.page_hashes:
            page = cache.find(h)
            if page is not None:
                assert torch.equal(pool.caches[0][page, 0], pool.caches[1][page, 0])
        if not seq.is_finished:
            assert len(seq.page_table) == pages_for(seq.num_computed, PAGE_SIZE)
    assert lagged >= (1 if draft == "TokenKV" else PAGE_SIZE)  # registration waited for it
    if draft == "TokenKV":  # caught up at every step
        assert len(seq.page_hashes) == len(seq.tokens[:-1]) // PAGE_SIZE
    assert pool.num_free_pages == pool.num_pages


def test_draft_lengths_take_only_free_pages_and_are_cut_at_the_pools_edge():
    speculator = Speculator(SpecConfig("draft-simple", draft_max=16), max_context=1000)
    seq = make_seq([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0))
    seq.tokens.append(3)
    seq.page_table, seq.num_computed = [0, 1], 8
    plan = [ScheduledSeq(seq, 1)]
    drafted = add_drafts(plan, speculator, 64, 1, PAGE_SIZE)
    assert drafted[0].draft_room == 3 and drafted[0].new_pages(PAGE_SIZE) == 1
    assert add_drafts(plan, speculator, 3, 1, PAGE_SIZE)[0].draft_room == 2  # token budget
    seq.tokens[-1:] = [3, 1, 2, 3]
    seq.page_table, seq.num_computed = [0, 1, 2], 11
    assert add_drafts(plan, speculator, 64, 0, PAGE_SIZE)[0].draft_room == 0  # the edge


def test_a_cancel_during_verification_frees_every_page_of_both_models():
    engine = make_engine(DRAFT)
    seq = make_seq(COPY_PROMPT, SamplingParams(temperature=0, max_tokens=200))
    engine.scheduler.add(seq)
    engine.runner.on_drafted = lambda: engine.cancel([seq.request_id])
    while not engine.runner.last_drafts:
        engine.step()
    assert seq.phase is Phase.RUNNING
    with engine.lock, engine._cond:
        engine._take_input()
    assert seq.finish_reason is FinishReason.CANCELLED and not seq.page_table
    assert engine.scheduler.pool.num_free_pages == engine.scheduler.pool.num_pages


def test_eos_among_the_drafts_ends_the_sequence_there():
    from test_speculation import eos_prompt

    outs = []
    for spec in (DRAFT, SpecConfig()):
        engine = make_engine(spec)
        seq = make_seq(eos_prompt(), SamplingParams(temperature=0, max_tokens=50))
        engine.scheduler.add(seq)
        run_to_the_end(engine)
        outs.append(seq.generated_ids)
        assert seq.finish_reason is FinishReason.STOP and seq.generated_ids[-1] == EOS
    assert outs[0] == outs[1]


def test_a_draft_must_share_the_targets_vocabulary_and_kv_head_shape():
    from kvpark.pod.model.loader import builtin_tokenizer

    tokens = builtin_tokenizer()
    tiny, draft = synthetic_config("tiny"), synthetic_config("tiny-draft")
    assert check_draft(tiny, draft, tokens, tokens) is None
    smollm2 = synthetic_config("smollm2-135m")
    assert "K/V heads are 3 x 8, the target's 3 x 64" in check_draft(smollm2, draft, tokens,
                                                                    tokens)
    llama = synthetic_config("llama-8b")
    assert "vocabulary has 49152 tokens, the target's 128256" in check_draft(
        llama, draft, tokens, tokens)


class AlwaysWrong(TokenKV):
    """A draft whose every guess is one past the target's: drafting soon pauses."""

    def logits(self, hidden, rows=None):
        return torch.roll(super().logits(hidden, rows), 1, dims=1)


class CountingDrafter(CheckingDrafter):
    """Counts the draft model's passes (each streams its weights once), and the largest
    one-sequence catch-up."""

    def __init__(self, pool: KVPool, model: TokenKV) -> None:
        super().__init__(pool, model)
        self.passes = 0
        self.largest_catch_up = 0

    def run(self, rows, argmax_rows):
        self.passes += 1
        self.largest_catch_up = max(self.largest_catch_up, *rows.q_lens)
        return super().run(rows, argmax_rows)


@pytest.mark.parametrize("park", PARKS)
def test_a_paused_sequence_is_not_fed_to_the_draft_model_which_catches_up_when_it_drafts(park):
    cache = PrefixCache("test", PAGE_SIZE)
    engine = make_engine(DRAFT, cache=cache, **PARKS[park])
    pool = engine.scheduler.pool
    drafter = engine.runner.drafter = CountingDrafter(pool, AlwaysWrong(pool))
    plain = make_engine(SpecConfig(), **PARKS[park])
    seqs = [make_seq(p, SamplingParams(temperature=0, max_tokens=120)) for p in PROMPTS]
    for seq in seqs:
        engine.scheduler.add(seq)
    steps = run_to_the_end(engine)
    assert [s.generated_ids for s in seqs] == run(plain, PROMPTS, max_tokens=120)
    stats = engine.scheduler.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    assert drafter.passes < steps // 2  # the pauses' decode rows made no pass of their own
    assert drafter.largest_catch_up > 8  # a pause's tokens, in one pass
    assert drafter.checked > 200 and drafter.wrong == []  # and its K/V were right when read


def test_the_target_as_its_own_draft_writes_the_targets_kv_bits_through_replays():
    """Real weights, real kernels: SmolLM2 drafting for itself, parked by recompute every 5
    tokens (replays mix prompt rows and generated rows in one chunk). The draft's K/V are the
    target's, bit for bit, at every complete position after every step, so its greedy drafts
    are all accepted: its rows take the kernels the target's take (generated rows the blocks)."""
    from kvpark.kernels.cpu_paged import CpuPagedAttention
    from kvpark.pod.args import parse_args
    from kvpark.pod.model.llama import LlamaModel
    from kvpark.pod.model.loader import load_model_files
    from kvpark.pod.serving.choices import pick_blocks
    from kvpark.pod.worker.runner import ModelRunner

    loaded = load_model_files("builtin://smollm2-135m")
    c = loaded.config
    model = LlamaModel(c, loaded.weights, quantized=pick_blocks(
        parse_args([], env={}), loaded, torch.device("cpu"), torch.float32))
    pool = KVPool(2 * c.num_layers, 32, 16, c.num_kv_heads, c.head_dim)
    spec = SpecConfig("draft-simple", draft_max=3)
    config = SchedulerConfig(num_slots=2, batch_size=64, preempt_every=5, spec=spec,
                             max_context=32 * 16)
    runner = ModelRunner(model, pool, CpuPagedAttention(),
                         drafter=Drafter(model, CpuPagedAttention(), pool.caches[c.num_layers:],
                                         16))
    engine = Engine(Scheduler(config, pool, Swapper(pool, HostStore(0)),
                              loaded.tokenizer.eos_token_ids), runner)
    prompt = loaded.tokenizer.encode("<|im_start|>user\nRepeat: one two three four five six "
                                     "seven eight nine ten<|im_end|>\n<|im_start|>assistant\n")
    seq = make_seq(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.scheduler.add(seq)
    compared = 0
    for _ in range(1000):  # a step may run nothing while the one sequence is parked
        if not engine.scheduler.has_work:
            break
        engine.step()
        if seq.is_finished or not seq.page_table:
            continue
        for p in range(seq.num_complete):
            page, at = seq.page_table[p // 16], p % 16
            for layer in range(c.num_layers):
                assert torch.equal(pool.caches[layer][page, :, at],
                                   pool.caches[c.num_layers + layer][page, :, at]), (p, layer)
            compared += 1
    stats = engine.scheduler.speculator.stats
    assert engine.scheduler.stats.n_preempt_recompute >= 4 and compared > 500
    assert stats.num_draft_tokens > 10 and stats.num_accepted_tokens == stats.num_draft_tokens
