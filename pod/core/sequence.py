"""A sequence being served: its tokens, pages, phase, preemption and speculation history.

A request with `n > 1` is a family of sequences; each occupies one of the `--parallel` slots.
`num_computed` counts the tokens whose K/V are in the pool; the next step feeds
`tokens[num_computed:]`, and a token is sampled only when that reaches the end of `tokens`.
Only the engine thread holds a sequence, and only the scheduler changes its pages and counts.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling.sampler import DraftSeed, SamplingParams, TokenLogprob, make_generator
from .messages import FinishReason, Submission

if TYPE_CHECKING:  # the GPU check imports this module without the tokenizer's dependencies
    from ..memory.host_tier import HostPage
    from ..model.tokenizer import Tokenizer
    from ..sampling.constraint import TokenConstraint
    from .text_output import TextOutput

_seq_ids = itertools.count()


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    RUNNING = "running"  # holds a slot; prefill, replay or decode
    PARKED = "parked"  # holds a slot, no pages: swapped to host or dropped for recompute
    FINISHED = "finished"


class PreemptMode(str, enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"
    CACHED = "cached"  # set at resume: everything came back from the cache, nothing replayed


@dataclass
class ParkState:
    """A sequence's preemption history and, while parked, what its park left behind."""

    n_preempt: int = 0
    n_recompute: int = 0
    mode: PreemptMode | None = None  # of the latest park
    parked_at: float | None = None  # None while not parked
    replay_until: int = 0  # recompute: while num_computed < replay_until it is replaying
    host_kv: torch.Tensor | None = None  # swap: the pages, [layers, pages, 2, ps, Hkv, D]
    host_bytes: int = 0
    # swap of a hybrid model: its state slot's bytes (conv + recurrent state), charged beside
    # host_kv to the same budget
    host_state: torch.Tensor | None = None
    swapped_tokens: int = 0  # num_computed at the moment of a swap park
    # swap: leading pages left in the pool because others held them too; with a host tier the
    # full pages after them, held there (host_kv starts after both)
    resident_pages: int = 0
    tier_pages: list[HostPage] = field(default_factory=list)
    # prefix cache: the full pages its park released into the cache, those a resume found
    # there again, and (while a resume copy is in flight) the ones it holds meanwhile
    cached_pages: list[int] = field(default_factory=list)
    restored_pages: int = 0
    restored_from_host: int = 0  # pages copied back from the host tier
    restored_from_disk: int = 0  # pages read back from the disk tier (a recompute's)
    resumed_from: tuple[str, ...] = ()  # the latest resume's sources: pool, host, disk, recompute
    held_pages: list[int] = field(default_factory=list)
    tokens_since_forced: int = 0  # for KVPARK_PREEMPT_EVERY
    manual: bool = False  # parked through POST /slots/{id}?action=park; waits for unpark
    for_reader: bool = False  # parked while its client reads far behind; waits for it
    seconds: float = 0.0  # total time parked

    @property
    def waits(self) -> bool:
        """Parked on purpose: the restore loop leaves it until what parked it lets go."""
        return self.manual or self.for_reader

    def begin(self, mode: PreemptMode, now: float) -> None:
        """A park starts: its mode and clock; the history counts it."""
        self.mode, self.parked_at = mode, now
        self.n_preempt += 1
        self.n_recompute += mode is PreemptMode.RECOMPUTE
        self.tokens_since_forced = 0

    def end(self, now: float) -> float:
        """Close the current park's clock; returns how long it lasted."""
        if self.parked_at is None:
            return 0.0
        lasted = now - self.parked_at
        self.seconds += lasted
        self.parked_at = None
        return lasted


@dataclass
class SpecState:
    """One sequence's speculation: totals for `timings`, and the adaptive pause."""

    num_drafts: int = 0  # verifications
    num_drafted: int = 0  # draft tokens fed (llama.cpp's draft_n)
    num_accepted: int = 0  # of which the samples matched (draft_n_accepted)
    misses: int = 0  # verifications in a row with nothing accepted
    draft_len: int = 0  # the next draft's length at most (0: --spec-draft-n-max)
    pause: int = 0  # the latest pause's length (0: never paused)
    paused_until: int = 0  # no drafting until num_generated reaches this
    # a draft model: computed tokens at the end whose K/V it has not written yet (after a fully
    # accepted draft, the last draft token; during a pause, the pause's tokens); its next pass
    # over the sequence feeds them first
    draft_lag: int = 0
    mtp_seed: DraftSeed | None = None  # draft-mtp: made at the end of the last step


@dataclass
class SeqOutput:
    """What a sequence produced and when (engine thread), copied into its `SeqResult` when it
    ended."""

    visible: TextOutput | None = None  # detokenizer and stop strings (None: ids only)
    # one per token of the visible output when the request asked for logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt_logprobs requests: entry i is prompt token i + 1's (the first has no row before
    # it); complete before the first sampled token, never rewritten by a replay
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None  # what went wrong, for a failure
    prompt_seconds: float = 0.0  # compute time of the prompt as sent (replays excluded)
    first_token_at: float | None = None
    finished_at: float | None = None
    # what TEXT events have told the request's owner so far (None: no TEXT event yet)
    num_reported_tokens: int | None = None
    num_reported_logprobs: int = 0


@dataclass(eq=False)
class Sequence:
    """One sequence, its state grouped by owner: the request as sent (`request`, never
    written), the engine's own state (the fields here), `parking` (the swapper's and the
    scheduler's) and `output`. Only the engine thread holds it."""

    request: Submission
    generator: torch.Generator
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # of its full pages (prefix cache)
    num_cached: int = 0  # prompt tokens found in the prefix cache at admission
    cached_from: tuple[str, ...] = ()  # where they were found: pool, host, disk
    # a hybrid model with a prefix cache: the page boundary its slot's state snapshot is at
    checkpoint_at: int = 0
    failed_steps: int = 0  # a hybrid's steps that failed in a row (`step_failure.py`)
    slot_id: int | None = None
    phase: Phase = Phase.WAITING
    arrival: float = field(default_factory=time.monotonic)
    last_step_at: float = 0.0  # when a step last gave it rows (monotonic; --prefill-first)
    parking: ParkState = field(default_factory=ParkState)
    spec: SpecState = field(default_factory=SpecState)  # drafts verified (--spec-type)
    constraint: TokenConstraint | None = None  # masks what may be sampled next (grammars)
    output: SeqOutput = field(default_factory=SeqOutput)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_ids)

    # the request as sent
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def index(self) -> int:  # its choice in the response
        return self.request.index

    @property
    def family_size(self) -> int:
        return self.request.family_size

    @property
    def priority(self) -> int:  # victims come from the lowest tier; restores go highest first
        return self.request.priority

    def mark_finished(self, reason: FinishReason, error: str | None, now: float) -> None:
        self.phase = Phase.FINISHED
        output = self.output
        output.finish_reason, output.error, output.finished_at = reason, error, now

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def draft_lag(self) -> int:
        return self.spec.draft_lag

    @property
    def mtp_seed(self) -> DraftSeed | None:
        return self.spec.mtp_seed

    @property
    def num_prompt_logprobs(self) -> int:
        """Prompt tokens whose logprobs were recorded (a replay does not record them again)."""
        return len(self.output.prompt_logprobs)

    @property
    def num_complete(self) -> int:
        """Computed tokens whose K/V every layer of the pool holds: a draft model's lag (its
        last draft token, not fed yet) excluded. Only pages full of these may be cached."""
        return self.num_computed - self.spec.draft_lag

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < self.num_prompt and not self.is_replaying

    @property
    def is_replaying(self) -> bool:
        return self.num_computed < self.parking.replay_until

    @property
    def is_parked(self) -> bool:
        return self.phase is Phase.PARKED

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.output.finish_reason

    @property
    def failed(self) -> bool:
        reason = self.output.finish_reason
        return reason is not None and reason.is_error

    @property
    def in_family(self) -> bool:
        return self.family_size > 1


def make_sequence(submission: Submission, tokenizer: Tokenizer | None) -> Sequence:
    """The engine's own state for a submission (`tokenizer` None: ids only, no text)."""
    output = constraint = None
    if tokenizer is not None:  # imported here: see TYPE_CHECKING above
        from ..sampling.grammar import get_grammars
        from ..sampling.reasoning_gate import gated
        from .text_output import TextOutput

        output = TextOutput(tokenizer, submission.params.stop)
        if submission.grammar is not None:
            constraint = get_grammars(tokenizer).constraint(submission.grammar)
        constraint = gated(submission.thinking, tokenizer, constraint)
    return Sequence(submission, make_generator(submission.seed), constraint=constraint,
                    output=SeqOutput(visible=output))
