"""The request as sent, for one sequence: what the HTTP side hands the engine (`handover.py`),
and the part of a `Sequence` nothing ever writes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sampling import SamplingParams

if TYPE_CHECKING:
    from .grammar import Grammar
    from .slot import SeqEvent, Sequence

# called on the engine thread with the sequence, what happened and a TOKEN's visible text
Report = Callable[["Sequence", "SeqEvent", str], None]


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
