"""What the runner reads of a step's plan, as protocols: the scheduler's `ScheduledSeq` and the
engine's `Sequence` are one, but the worker layer never imports the core layer above it (it is
handed the plan, it does not know who made it), and it never writes to either."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..sampling.sampler import DraftSeed, SamplingParams

if TYPE_CHECKING:
    from ..sampling.constraint import TokenConstraint


class FedSequence(Protocol):
    """A sequence as a step reads it."""

    @property
    def request_id(self) -> str: ...

    @property
    def slot_id(self) -> int | None: ...

    @property
    def tokens(self) -> list[int]: ...

    @property
    def prompt_ids(self) -> tuple[int, ...]: ...

    @property
    def num_prompt(self) -> int: ...

    @property
    def num_computed(self) -> int: ...

    @property
    def page_table(self) -> list[int]: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator: ...

    @property
    def constraint(self) -> TokenConstraint | None: ...

    @property
    def num_prompt_logprobs(self) -> int: ...

    @property
    def draft_lag(self) -> int: ...

    @property
    def mtp_seed(self) -> DraftSeed | None: ...


class PlannedChunk(Protocol):
    """One sequence's part of a step: `num_tokens` of its tokens from `num_computed` on, then
    its draft rows."""

    @property
    def seq(self) -> FedSequence: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def draft(self) -> tuple[int, ...]: ...

    @property
    def draft_room(self) -> int: ...

    @property
    def feeds_draft_model(self) -> bool: ...

    @property
    def wants_seed(self) -> bool: ...

    @property
    def num_rows(self) -> int: ...

    @property
    def samples(self) -> bool: ...

    def with_draft(self, draft: tuple[int, ...]) -> PlannedChunk: ...
