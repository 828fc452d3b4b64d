"""A hybrid model's failed step (`worker.runner.StateLost`): its DeltaNet layers may have advanced
the state slot of every sequence in it, so the step cannot be rerun as a dense model's is (that
would feed its tokens twice). Each of them is parked by recompute instead: the state is dropped
and the replay, from the latest checkpoint or token 0, rebuilds the bits the first pass had (on
the CPU exactly; pages of computed tokens were never touched). Which one made the step fail is
not known, so each then runs alone until a step of its own succeeds; one that fails alone ends
with the error, and the others go on to the bytes they would have given."""

from __future__ import annotations

from typing import Protocol

from .messages import FinishReason
from .sequence import PreemptMode, Sequence
from .step_plan import ScheduledSeq


class Parks(Protocol):
    """What recovery asks of the scheduler (which plans with `isolate`)."""

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None: ...

    def park(self, seq: Sequence, wait: bool = True, recompute: bool = False
             ) -> PreemptMode: ...


def recover(scheduler: Parks, plan: list[ScheduledSeq], error: str) -> None:
    """After a failed step: end a sequence that failed alone, park the rest by recompute."""
    alone = len(plan) == 1 and plan[0].seq.failed_steps > 0
    for item in plan:
        if alone:
            scheduler.finish(item.seq, FinishReason.ENGINE_ERROR, error)
            continue
        item.seq.failed_steps += 1
        scheduler.park(item.seq, recompute=True)


def isolate(plan: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """A step holding a sequence of a failed step runs that one alone (before its pages are
    given: the others keep theirs for the next step)."""
    suspects = [item for item in plan if item.seq.failed_steps]
    return suspects[:1] if suspects else plan
