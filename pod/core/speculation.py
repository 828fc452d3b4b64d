"""Speculative decoding: drafts by prompt lookup (`--spec-type ngram-simple`) or by a draft
model (`--model-draft`, `--spec-type draft-simple`), verified by the target model.

Drafting by lookup: the last n tokens of a sequence (prompt and generated; n from `NGRAM_MAX`
down to 1) are looked up at their most recent earlier occurrence, and the tokens that followed
it there are proposed (llama.cpp's ngram-simple, vLLM's `ngram`). A draft model proposes its
greedy continuation instead (`draft_model.py`); the scheduler grants it only a draft length and
its pages. Either way the step feeds [last sampled token, d1..dk] as k + 1 rows of the same
sequence.

Verification (`sampling/verification.py`) is exact-match acceptance, not rejection sampling: the
rows' logits are sampled in
order with the sequence's own generator, stopping at the first row whose sample differs from
the next draft token (that sample is the correction; when all k match, the last row gives one
token more). Row i sees exactly the context plain decoding would show it (the drafts before it
equal the samples before it) and its logits are the same bits (decode rows are a property of
each row alone), and the generator is asked exactly as often, in the same order: every emitted
token is drawn from the target model's own distribution, so greedy and seeded sampling give
byte-identical output with speculation on or off. A draft is only a guess of which rows to
compute early; it never changes what is sampled.

Page accounting: draft rows take pages only from the pool's truly free pages (never evicting the
prefix cache, never parking anyone), and a verification gives back every page past the accepted
tokens (the scheduler, after the step: `pages_past`), so between steps a page table holds exactly
the pages of its computed tokens, as without speculation: parks, the prefix cache and slot files
see no drafts.

Adaptive, per sequence: the next draft is as long as the last one's accepted run plus one
(all accepted: twice as long, up to `--spec-draft-n-max`), so a failing guess costs one extra
row, not n-max (on a CPU each decode row costs compute: measured in benchmarks/README.md).
Drafts with nothing accepted `MISSES_TO_PAUSE` times in a row stop drafting for `PAUSE_MIN`
generated tokens, doubled on each further pause up to `PAUSE_MAX`; a fully accepted draft of at
least `RUN_TO_RESUME` tokens resets the pause. Free text then costs a couple of one-row guesses
per pause period.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from ..memory.paging import pages_for
from .sequence import Sequence, SpecState

NGRAM_MAX = 3  # the longest suffix looked up (llama.cpp's ngram-simple idea, vLLM's n-gram)
MISSES_TO_PAUSE = 2  # drafts with nothing accepted, in a row, before a sequence pauses
PAUSE_MIN = 8  # generated tokens without drafting after the first pause
PAUSE_MAX = 256  # the longest pause (a copy that starts late in free text is still found)
# a fully accepted draft this long ends the pausing; a one-token one does not: free text
# matches one looked-up token ~15% of the time, and each lucky one put a sequence back to
# drafting every step (4 chats of story text measured 0.95x, with this 1.00x: benchmarks/)
RUN_TO_RESUME = 2


@dataclass(frozen=True)
class SpecConfig:
    """`--spec-type`, `--spec-draft-n-max`, `--spec-draft-n-min`."""

    # "none", "ngram-simple", "draft-simple" (a draft model) or "draft-mtp" (the model's MTP head)
    kind: str = "none"
    draft_max: int = 3  # tokens drafted per step at most
    draft_min: int = 0  # a shorter proposal is not verified (llama.cpp's n-min)
    # a step's rows at most with drafts in it (0: no cap). On the CPU the C kernels stream the
    # weights once per tile of 4 rows and every row costs compute: drafts fill what the plain
    # rows leave of the tile, where a row is nearly free (benchmarks/README.md)
    max_step_rows: int = 0

    @property
    def enabled(self) -> bool:
        return self.kind != "none" and self.draft_max > 0

    @property
    def uses_model(self) -> bool:
        """Drafts come from a model when the step runs (a draft model or the MTP head), not
        from the plan: the plan grants a length."""
        return self.enabled and self.kind in ("draft-simple", "draft-mtp")

    @property
    def uses_draft_model(self) -> bool:
        """A separate draft model, which may lag behind its target (`SpecState.draft_lag`)."""
        return self.enabled and self.kind == "draft-simple"

    @property
    def uses_mtp(self) -> bool:
        return self.enabled and self.kind == "draft-mtp"

    @property
    def n_spec(self) -> int:
        """Cells a step may need past a sequence's tokens: the spec's `n_spec` (limitation 4)."""
        return self.draft_max if self.enabled else 0


@dataclass
class SpecStats:
    """Server totals the metrics read (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


# ---- drafting and acceptance (pure) -----------------------------------------------------------

def find_draft(tokens: Seq[int], max_length: int, ngram_max: int = NGRAM_MAX) -> list[int]:
    """The up to `max_length` tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` (n = ngram_max .. 1) found; [] when none occurs."""
    end = len(tokens)
    if end < 2 or max_length <= 0:
        return []
    last = tokens[-1]
    # where an earlier n-gram could end: positions holding the last token, most recent first
    ends = [j for j in range(end - 2, -1, -1) if tokens[j] == last]
    for n in range(min(ngram_max, end - 1), 0, -1):
        suffix = list(tokens[end - n:])
        for j in ends:
            if j + 1 >= n and list(tokens[j + 1 - n:j + 1]) == suffix:
                return list(tokens[j + 1:j + 1 + max_length])
    return []


def next_pause(state: SpecState, num_generated: int) -> None:
    """Adapt after a verification (`state.misses` already counted): pause a sequence whose
    drafts keep failing, longer each time."""
    if state.misses < MISSES_TO_PAUSE:
        return
    state.pause = min(PAUSE_MAX, state.pause * 2) if state.pause else PAUSE_MIN
    state.paused_until = num_generated + state.pause
    state.misses = 0


# ---- the scheduler's and the engine's side ---------------------------------------------------

class Speculator:
    """Proposes each decode row's draft when a step is planned and settles it after the step.
    Sequences with a grammar, logits processing or logprobs are not speculated: their samplers
    keep per-token state that plain decoding advances one token at a time."""

    def __init__(self, config: SpecConfig, max_context: int) -> None:
        self.config = config
        self.max_context = max_context  # tokens one sequence may reach
        self.stats = SpecStats()

    def can_draft(self, seq: Sequence) -> bool:
        return self.drafts_when_not_paused(seq) and not self.is_paused(seq) \
            and (not self.config.uses_mtp or self.has_mtp_seed(seq))

    def may_draft_next(self, seq: Sequence, drafted: int) -> bool:
        """draft-mtp: whether the sequence may draft in the step after this one (which drafts
        `drafted` tokens and so generates at least one token more): a paused sequence needs no
        guess until its pause is about to end."""
        return (self.config.uses_mtp and seq.params.is_plain and seq.constraint is None
                and seq.num_generated + 1 + drafted >= seq.spec.paused_until)

    @staticmethod
    def has_mtp_seed(seq: Sequence) -> bool:
        """The MTP head's first guess is for the token after the last computed one: made at
        the end of the step that computed it (a replay's last step makes none)."""
        seed = seq.spec.mtp_seed
        return seed is not None and seed.position == seq.num_computed - 1

    def drafts_when_not_paused(self, seq: Sequence) -> bool:
        return (self.config.enabled and seq.num_pending == 1 and not seq.is_replaying
                and not seq.in_prompt and seq.params.is_plain and seq.constraint is None)

    @staticmethod
    def is_paused(seq: Sequence) -> bool:
        return seq.num_generated < seq.spec.paused_until

    def skips_draft_model(self, seq: Sequence) -> bool:
        """A draft model need not see a paused sequence's decode rows: it falls behind by them
        (`SpecState.draft_lag`, at most a pause) and takes them in one pass when the sequence
        drafts again. Everything else it feeds as the target does (prompts and replays too)."""
        return self.config.uses_draft_model and self.drafts_when_not_paused(seq) \
            and self.is_paused(seq)

    def draft_length(self, seq: Sequence, room: int) -> int:
        """How many tokens the sequence may have drafted this step: at most `room`, the
        adaptive length, and no more than it may still emit (the output limit, the context)
        minus the one token the last row adds; 0 below n-min."""
        if not self.can_draft(seq):
            return 0
        left = self.max_context - len(seq.tokens)
        limit = seq.params.tokens_left(seq.num_generated)
        if limit is not None:
            left = min(left, limit)
        # never below n-min: a shorter draft would be refused and the length never grow back
        longest = max(seq.spec.draft_len or self.config.draft_max, self.config.draft_min)
        length = min(longest, self.config.draft_max, room, left - 1)
        return length if length > 0 and length >= self.config.draft_min else 0

    def propose(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """A draft by prompt lookup of at most `draft_length` tokens (none under n-min)."""
        draft = find_draft(seq.tokens, self.draft_length(seq, room))
        return tuple(draft) if draft and len(draft) >= self.config.draft_min else ()

    def draft_model_fed(self, seq: Sequence, fed: bool, num_tokens: int) -> None:
        """A step's `num_tokens` rows are computed: a draft model's pass fed them (and its lag),
        or it falls behind by them."""
        if self.config.uses_draft_model:
            seq.spec.draft_lag = 0 if fed else seq.spec.draft_lag + num_tokens

    def settle(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count a verification of `drafted` tokens, `accepted` of them matched. A draft model
        never fed its last draft token: when all were accepted its next pass does, first."""
        state = seq.spec
        if self.config.uses_draft_model:
            state.draft_lag = int(accepted == drafted)
        state.num_drafts += 1
        state.num_drafted += drafted
        state.num_accepted += accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += drafted
        self.stats.num_accepted_tokens += accepted
        # everything matched: twice as long next time (a copy reaches n-max in a few steps, a
        # lucky one-token match in free text does not buy a long guess); else one past the match
        state.draft_len = min(self.config.draft_max, 2 * drafted) if accepted == drafted \
            else accepted + 1
        if accepted == drafted and drafted >= RUN_TO_RESUME:
            state.misses, state.pause = 0, 0
        elif accepted:
            state.misses = 0
        else:
            state.misses += 1
            next_pause(state, seq.num_generated)


def draft_room(num_computed: int, num_rows: int, num_pages: int, free_pages: int,
               page_size: int) -> int:
    """Draft tokens that fit after a chunk of `num_rows` rows in the sequence's `num_pages`
    pages plus `free_pages` more."""
    return (num_pages + free_pages) * page_size - num_computed - num_rows


def pages_past(num_tokens: int, page_table: list[int], page_size: int) -> list[int]:
    """The pages of a table beyond those `num_tokens` tokens fill (drafts' pages)."""
    return page_table[pages_for(num_tokens, page_size):]
