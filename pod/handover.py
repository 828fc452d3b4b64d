"""What crosses between the event loop and the engine thread, as values: a `Submission` goes in
(one per sequence, `submission.py`), and a `SeqResult` comes out when the sequence ended. The
engine builds its own `Sequence` from a submission and nobody else ever holds it, so the event
loop never reads state the engine thread is writing (`bridge.py` carries the events between).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sampling import TokenLogprob, make_generator
from .slot import FinishReason, SeqOutput, Sequence
from .submission import Submission

if TYPE_CHECKING:  # the GPU check runs the engine without the tokenizer's dependencies
    from .model.tokenizer import Tokenizer

def make_sequence(submission: Submission, tokenizer: Tokenizer | None) -> Sequence:
    """The engine's own state for a submission (`tokenizer` None: ids only, no text)."""
    output = constraint = None
    if tokenizer is not None:  # imported here: see TYPE_CHECKING above
        from .grammar import get_grammars
        from .text_output import TextOutput

        output = TextOutput(tokenizer, submission.params.stop)
        if submission.grammar is not None:
            constraint = get_grammars(tokenizer).constraint(submission.grammar)
    return Sequence(submission, make_generator(submission.seed), constraint=constraint,
                    output=SeqOutput(visible=output))


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
        assert seq.output.finish_reason is not None, "a result is taken when the sequence ended"
        output, visible = seq.output, seq.output.visible
        return cls(
            seq.index, seq.family_size, output.finish_reason, output.error,
            visible.text if visible is not None else "",
            visible is not None and visible.stopped, seq.prompt_ids,
            tuple(seq.generated_ids), seq.num_cached, seq.slot_id, output.prompt_seconds,
            output.first_token_at, output.finished_at, tuple(output.logprobs),
            tuple(output.prompt_logprobs), seq.spec.num_drafts, seq.spec.num_drafted,
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
