"""A sequence being served: its tokens, pages, phase and preemption history.

A request with `n > 1` is a family of sequences; each occupies one of the `--parallel` slots.
`num_computed` counts the tokens whose K/V are in the pool; the next step feeds
`tokens[num_computed:]`, and a token is sampled only when that reaches the end of `tokens`.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .sampling import SamplingParams, TokenLogprob
from .speculation import SpecState
from .submission import Submission

if TYPE_CHECKING:  # the GPU check imports this module without the tokenizer's dependencies
    from .constraint import TokenConstraint
    from .host_tier import HostPage
    from .text_output import TextOutput

_seq_ids = itertools.count()


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    RUNNING = "running"  # holds a slot; prefill, replay or decode
    PARKED = "parked"  # holds a slot, no pages: swapped to host or dropped for recompute
    FINISHED = "finished"


class SeqEvent(str, enum.Enum):
    """What the engine tells a sequence's owner through `Sequence.on_event` (engine thread)."""

    TOKEN = "token"  # a token was sampled; the text is what it adds to the visible output
    QUEUED = "queued"  # submitted, and the step after found no slot for it: it waits
    PARKED = "parked"
    RESUMED = "resumed"
    RECOMPUTED = "recomputed"  # a recompute replay caught up with where it was parked
    PROGRESS = "progress"  # a chunk of the prompt (as sent, not a replay) was computed
    FINISHED = "finished"  # see finish_reason


CONTEXT_EXCEEDED = "Context size has been exceeded."  # the spec's (and llama.cpp's) words


class FinishReason(str, enum.Enum):
    """Why a sequence ended. The first three are normal endings; the rest are failures, which
    the API maps to HTTP statuses."""

    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens, or the context the sequence may reach
    CANCELLED = "cancelled"  # the client went away
    PROMPT_TOO_LONG = "prompt_too_long"  # larger than the whole pool: it can never run
    CONTEXT_EXCEEDED = "context_exceeded"  # the pool could not grow it and nobody could park
    ENGINE_ERROR = "engine_error"  # a step failed for it
    SHUTDOWN = "shutdown"  # the server stopped before it finished

    @property
    def is_error(self) -> bool:
        return self not in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED)


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
    resumed_from: tuple[str, ...] = ()  # the latest resume's sources: pool, host, recompute
    held_pages: list[int] = field(default_factory=list)
    tokens_since_forced: int = 0  # for KVPARK_PREEMPT_EVERY
    manual: bool = False  # parked through POST /slots/{id}?action=park; waits for unpark
    seconds: float = 0.0  # total time parked

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
    slot_id: int | None = None
    phase: Phase = Phase.WAITING
    arrival: float = field(default_factory=time.monotonic)
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

    def on_event(self, event: SeqEvent, text: str = "") -> None:
        """Tell the request's owner (engine thread); `text` is a TOKEN's visible output."""
        self.request.report(self, event, text)

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


@dataclass(frozen=True)
class SlotView:
    """A slot's occupant as /slots shows it, copied on the engine's lock."""

    request_id: str
    parked: bool
    n_preempt: int
    n_recompute: int
    preempt_mode: str | None
    manual: bool
    num_computed: int
    num_prompt: int
    num_generated: int
    priority: int
    phase: str  # parked, replay, prompt or generating
    resumed_from: tuple[str, ...]  # where its latest resume found its K/V (empty: never)

    @classmethod
    def of(cls, seq: Sequence) -> SlotView:
        phase = ("parked" if seq.is_parked else "replay" if seq.is_replaying
                 else "prompt" if seq.in_prompt else "generating")
        mode = seq.parking.mode
        return cls(seq.request_id, seq.is_parked, seq.parking.n_preempt, seq.parking.n_recompute,
                   mode.value if mode else None, seq.parking.manual, seq.num_computed,
                   seq.num_prompt, seq.num_generated, seq.priority, phase,
                   seq.parking.resumed_from)
