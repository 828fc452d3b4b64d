"""One step's plan as pure functions: which sequences feed how many tokens, within the token
budget and the pages the pool can give (the scheduler decides who is running at all)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..memory.paging import pages_for
from .sequence import Sequence
from .speculation import Speculator, draft_room


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # fed this step: tokens[num_computed : num_computed + num_tokens]
    # speculation: guessed next tokens fed after them as rows of their own, to be verified
    draft: tuple[int, ...] = ()
    # a draft model's: the draft length granted (pages included), filled when the step runs
    draft_room: int = 0
    # whether the draft model feeds this step's rows (and what it lags behind): not while the
    # sequence's drafting is paused (`Speculator.skips_draft_model`)
    feeds_draft_model: bool = True
    # draft-mtp: the MTP head's end-of-step pass also makes the next step's first guess (its
    # logits cost an LM head), for a sequence that may draft next step
    wants_seed: bool = False

    @property
    def num_rows(self) -> int:
        return self.num_tokens + max(len(self.draft), self.draft_room)

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)

    def with_draft(self, draft: tuple[int, ...]) -> ScheduledSeq:
        """The same chunk with a draft model's tokens in the room it was granted."""
        return dataclasses.replace(self, draft=draft)

    def new_pages(self, page_size: int) -> int:
        """Pages the step adds to the sequence's page table (draft rows' included)."""
        return pages_for(self.seq.num_computed + self.num_rows, page_size) - len(
            self.seq.page_table)


def prefilling(seq: Sequence) -> bool:
    """A prompt or a replay: more than one token to feed before the next sample (else a decode
    row)."""
    return seq.num_pending > 1


def step_order(running: list[Sequence]) -> list[Sequence]:
    """Decode rows first (cheap, latency-bound), then prefill and replay by arrival."""
    return sorted(running, key=lambda s: (prefilling(s), s.arrival, s.seq_id))


def hold_decode_rows(running: list[Sequence], batch_size: int, now: float, wait: float
                     ) -> tuple[list[Sequence], int]:
    """Prefill first (`--prefill-first`): while the sequences in a prompt or a replay have more
    tokens to feed than one step takes, the decode rows sit the step out until one of their
    sequences has waited `wait` seconds since its last row; then every decode row steps, in a
    step of their own. Returns (who may step, in order; how many decode rows sat out).

    On the CPU a step's decode rows read weights of their own (the GGUF's blocks) beside the
    prompt rows' (bf16 tiles), a pass whose cost hardly grows with the number of rows: while
    prompts queue, decode rows gathered into fewer steps give the prompts' first tokens sooner
    and more tokens a second, for a stall of at most `wait` and a step between two tokens.
    Gathered into a decode step of their own (one C call for every layer) rather than beside
    the prompt rows (a mixed step: per-layer calls, float32 attention rows for the o
    projection): the two steps take less time than the one (`benchmarks/mixed_step.py`)."""
    if wait <= 0:
        return running, 0
    if sum(s.num_pending for s in running if prefilling(s)) < batch_size:
        return running, 0
    decoding = [s for s in running if not prefilling(s)]
    if any(now - s.last_step_at >= wait for s in decoding):
        return decoding, 0
    return [s for s in running if prefilling(s)], len(decoding)


@dataclass
class StepCandidates:
    """Who may feed rows in the next step, in step order: every running sequence but the decode
    rows that sit it out for waiting prompts (`hold_decode_rows`); the scheduler stamps those
    that stepped. `held` counts the rows that sat a step out (a metric)."""

    prefill_first: float  # seconds a decode row may sit out (0: never)
    batch_size: int
    clock: Callable[[], float] = time.monotonic  # tests set their own
    held: int = 0
    _now: float = field(default=0.0, init=False)  # the latest pick's time and count
    _held_now: int = field(default=0, init=False)

    def pick(self, running: list[Sequence]) -> list[Sequence]:
        self._now = self.clock()
        kept, self._held_now = hold_decode_rows(step_order(running), self.batch_size, self._now,
                                                self.prefill_first)
        return kept

    def stepped(self, plan: list[ScheduledSeq]) -> None:
        self.held += self._held_now
        for item in plan:
            item.seq.last_step_at = self._now


def grant_pages(running: list[Sequence], batch_size: int, free_pages: int,
                page_size: int, prompt_checkpoints: bool = False
                ) -> tuple[list[ScheduledSeq], list[Sequence]]:
    """Give each sequence, in order, its next step within the token budget and the free pages.

    A prefill chunk is shortened to the pages that are free; a sequence that cannot feed even
    one token is blocked. Returns (plan, blocked).
    """
    budget, free = batch_size, free_pages
    plan: list[ScheduledSeq] = []
    blocked: list[Sequence] = []
    for seq in running:
        if budget == 0:
            break
        room = (len(seq.page_table) + free) * page_size - seq.num_computed
        num_tokens = min(seq.num_pending, budget, room)
        if prompt_checkpoints:  # a hybrid's state is saved where a step ends on a page
            num_tokens = stop_at_prompt_page(seq, num_tokens, page_size)
        if num_tokens <= 0:
            blocked.append(seq)
            continue
        item = ScheduledSeq(seq, num_tokens)
        free -= item.new_pages(page_size)
        budget -= num_tokens
        plan.append(item)
    return plan, blocked


def prompt_page_end(seq: Sequence, page_size: int) -> int:
    """The prompt's last page boundary: the next turn of a conversation re-sends at least the
    prompt, so a state checkpoint there is one it can resume from."""
    return seq.num_prompt // page_size * page_size


def stop_at_prompt_page(seq: Sequence, num_tokens: int, page_size: int) -> int:
    """A chunk that would cross the prompt's last page boundary ends on it."""
    boundary = prompt_page_end(seq, page_size)
    if seq.num_computed < boundary < seq.num_computed + num_tokens:
        return boundary - seq.num_computed
    return num_tokens


def step_pages(plan: list[ScheduledSeq], page_size: int) -> int:
    return sum(item.new_pages(page_size) for item in plan)


def add_drafts(plan: list[ScheduledSeq], speculator: Speculator, batch_size: int,
               free_pages: int, page_size: int) -> list[ScheduledSeq]:
    """The plan with draft rows after its decode rows, within the token budget it leaves (and
    the speculator's cap on a step's rows) and the `free_pages` left after its own pages: a
    draft never makes a step park anyone or evict a cached page (the caller passes the pool's
    unused pages, cached ones not counted), and a draft is cut to what fits, so a sequence at
    the pool's edge decodes plainly."""
    rows = sum(item.num_rows for item in plan)
    budget = batch_size - rows
    if speculator.config.max_step_rows:
        budget = min(budget, speculator.config.max_step_rows - rows)
    free = max(0, free_pages - step_pages(plan, page_size))
    drafted: list[ScheduledSeq] = []
    for item in plan:
        seq, own = item.seq, item.new_pages(page_size)
        room = min(budget, draft_room(seq.num_computed, item.num_rows,
                                      len(seq.page_table) + own, free, page_size))
        if item.samples and room > 0:
            item = with_draft(item, speculator, room)
            free -= item.new_pages(page_size) - own
            budget -= item.num_rows - item.num_tokens
        if item.samples and speculator.may_draft_next(seq, item.num_rows - item.num_tokens):
            item = dataclasses.replace(item, wants_seed=True)
        drafted.append(item)
    return drafted


def with_draft(item: ScheduledSeq, speculator: Speculator, room: int) -> ScheduledSeq:
    """The item with its draft by lookup, or the draft model's length, within `room`."""
    if speculator.config.uses_model:
        length = speculator.draft_length(item.seq, room)
        return ScheduledSeq(item.seq, item.num_tokens, draft_room=length,
                            feeds_draft_model=not speculator.skips_draft_model(item.seq))
    draft = speculator.propose(item.seq, room)
    return ScheduledSeq(item.seq, item.num_tokens, draft) if draft else item
