"""What crosses between the event loop and the engine thread, as values: a `Submission` goes in
(one per sequence), and a `SeqResult` comes out when the sequence ended. The engine builds its
own `Sequence` from a submission and nobody else ever holds it, so the event loop never reads
state the engine thread is writing (`bridge.py` carries the events in between).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sampling import SamplingParams, TokenLogprob, make_generator
from .slot import FinishReason, SeqEvent, Sequence

if TYPE_CHECKING:  # the GPU check runs the engine without the tokenizer's dependencies
    from .grammar import Grammar
    from .model.tokenizer import Tokenizer

# called on the engine thread with the sequence, what happened and a TOKEN's visible text
Report = Callable[[Sequence, SeqEvent, str], None]


@dataclass(frozen=True)
class Submission:
    """One sequence of a request, as the HTTP side hands it to the engine."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int | None  # its own: the request's seed plus its place among the n choices
    report: Report
    index: int = 0  # its choice in the response (prompt p's j-th choice is p * n + j)
    family_size: int = 1
    priority: int = 0
    grammar: Grammar | None = None  # compiled by the parser; each sequence walks its own


def make_sequence(submission: Submission, tokenizer: Tokenizer | None) -> Sequence:
    """The engine's own state for a submission (`tokenizer` None: ids only, no text)."""
    output = constraint = None
    if tokenizer is not None:  # imported here: see TYPE_CHECKING above
        from .grammar import get_grammars
        from .text_output import TextOutput

        output = TextOutput(tokenizer, submission.params.stop)
        if submission.grammar is not None:
            constraint = get_grammars(tokenizer).constraint(submission.grammar)
    return Sequence(
        request_id=submission.request_id, prompt_ids=list(submission.prompt_ids),
        params=submission.params, generator=make_generator(submission.seed),
        on_event=submission.report, index=submission.index,
        family_size=submission.family_size, priority=submission.priority, output=output,
        constraint=constraint)


@dataclass(frozen=True)
class SeqResult:
    """A sequence as it ended, copied on the engine thread: all a response says of it."""

    index: int
    family_size: int
    finish_reason: FinishReason
    error: str | None
    text: str  # the visible output, stop strings cut
    stopped_by_word: bool  # a stop string ended it (llama.cpp's stop_type "word")
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]
    num_cached: int  # prompt tokens found in the prefix cache at admission
    slot_id: int | None
    prompt_seconds: float
    first_token_at: float | None
    finished_at: float | None
    logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob, ...]
    num_drafts: int  # speculation: verifications, draft tokens fed, of them accepted
    num_drafted: int
    num_accepted: int
    n_preempt: int
    n_recompute: int

    @classmethod
    def of(cls, seq: Sequence) -> SeqResult:
        """Engine thread, once the sequence finished (nothing writes it after)."""
        assert seq.finish_reason is not None, "a result is taken when the sequence ended"
        output = seq.output
        return cls(
            seq.index, seq.family_size, seq.finish_reason, seq.error,
            output.text if output is not None else "",
            output is not None and output.stopped, tuple(seq.prompt_ids),
            tuple(seq.generated_ids), seq.num_cached, seq.slot_id, seq.prompt_seconds,
            seq.first_token_at, seq.finished_at, tuple(seq.logprobs),
            tuple(seq.prompt_logprobs), seq.spec.num_drafts, seq.spec.num_drafted,
            seq.spec.num_accepted, seq.parking.n_preempt, seq.parking.n_recompute)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.generated_ids)

    @property
    def failed(self) -> bool:
        return self.finish_reason.is_error
