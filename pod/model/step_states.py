"""What a step's delta-net layers read and write of the state slots: each chunk's slot and rows.

The state pool (`memory/state_pool.py`) owns the tensors; the runner says, per planned chunk,
which slot its sequence holds and whether it starts from nothing (a chunk at position 0, so a
recompute replay starts from the zero state as the first pass did), and where a speculative
chunk keeps the state after each of its rows (the scheduler takes back the rows of rejected
drafts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvpark.kernels.delta_rule import Spans, make_spans


@dataclass(frozen=True)
class StateChunk:
    slot: int
    start_row: int  # the chunk's first row in the step
    num_rows: int
    fresh: bool  # at position 0: conv and recurrent state start at zero
    keep_rows: bool = False  # a speculative chunk: keep the state after each row but its last

    @property
    def row_by_row(self) -> bool:
        """Mixed a row at a time (the same bits: every row is the same per-token recurrence),
        so the state after each row can be kept."""
        return self.keep_rows and self.num_rows > 1


@dataclass(frozen=True)
class StepStates:
    conv: list[torch.Tensor]  # per delta-net layer: [slots, conv_dim, kernel - 1]
    recurrent: list[torch.Tensor]  # per delta-net layer: [slots, heads, k_dim, v_dim] float32
    chunks: tuple[StateChunk, ...]
    # per delta-net layer: [slots, draft rows, *state]: where a `keep_rows` chunk's states go
    row_conv: list[torch.Tensor] = field(default_factory=list)
    row_recurrent: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return self.conv[0].shape[0]

    @cached_property
    def whole_spans(self) -> Spans:
        """The chunks mixed whole, checked once a step for every delta-net layer."""
        return make_spans([(c.slot, c.start_row, c.num_rows) for c in self.chunks
                           if not c.row_by_row], self.num_slots)

    @cached_property
    def row_chunks(self) -> tuple[StateChunk, ...]:
        return tuple(c for c in self.chunks if c.row_by_row)
