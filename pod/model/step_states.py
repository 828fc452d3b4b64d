"""What a step's delta-net layers read and write of the state slots: each chunk's slot and rows.

The state pool (`memory/state_pool.py`) owns the tensors; the runner says, per planned chunk,
which slot its sequence holds and whether it starts from nothing (a chunk at position 0, so a
recompute replay starts from the zero state as the first pass did)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateChunk:
    slot: int
    start_row: int  # the chunk's first row in the step
    num_rows: int
    fresh: bool  # at position 0: conv and recurrent state start at zero


@dataclass(frozen=True)
class StepStates:
    conv: list[torch.Tensor]  # per delta-net layer: [slots, conv_dim, kernel - 1]
    recurrent: list[torch.Tensor]  # per delta-net layer: [slots, heads, k_dim, v_dim] float32
    chunks: tuple[StateChunk, ...]
