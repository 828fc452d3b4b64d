"""The pool's second kind of memory: a hybrid model's per-sequence state slots.

A Gated DeltaNet layer keeps no K/V pages; its memory of a sequence is a fixed-size conv state
and a recurrent state, the same size at token 10 as at token 10,000. Slot `i` of every layer
belongs to the scheduler's slot `i` (`--parallel` of them), so the slot a sequence runs in is its
state slot and no second allocator exists. A park gives it up: a swap copies it to host RAM with
the pages (`read`, charged to the same budget) and a resume writes it back (`write`); a
recompute drops it, and the replay starts from zeros at position 0 (`step_states.StateChunk`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import DeltaNetConfig
from ..model.step_states import StateChunk, StepStates


@dataclass(frozen=True)
class StatePart:
    """One tensor of a flat state slot, in the order `read` lays them out."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty(0, dtype=self.dtype).element_size()


def split_state(flat: torch.Tensor, layout: tuple[StatePart, ...]) -> list[torch.Tensor]:
    """Views of a flat uint8 state as its typed parts (a slot file's checks read them)."""
    parts, at = [], 0
    for part in layout:
        parts.append(flat[at:at + part.num_bytes].view(part.dtype).reshape(part.shape))
        at += part.num_bytes
    assert at == flat.numel(), "a state of another layout"
    return parts


class StatePool:
    def __init__(self, num_slots: int, num_layers: int, shape: DeltaNetConfig,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 snapshots: bool = False, draft_rows: int = 0) -> None:
        """`snapshots`: a second copy of every slot, where the state at the sequence's latest
        page boundary waits to become a checkpoint (`checkpoints.py`). `draft_rows`: the
        longest draft of speculative decoding; a speculative step keeps the state after each
        of a chunk's rows but its last (`row_states`), so the rows past the last accepted
        draft can be taken back."""
        assert num_slots > 0 and num_layers > 0
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.conv = [torch.zeros(num_slots, *shape.conv_state_shape, dtype=dtype,
                                 device=self.device) for _ in range(num_layers)]
        # the recurrence runs in float32 whatever the weights are (as the reference kernels)
        self.recurrent = [torch.zeros(num_slots, *shape.recurrent_state_shape,
                                      dtype=torch.float32, device=self.device)
                          for _ in range(num_layers)]
        self.snapshots = ([torch.zeros_like(t) for t in (*self.conv, *self.recurrent)]
                          if snapshots else [])
        self.draft_rows = draft_rows
        # per part: [slots, draft_rows, *part] (conv parts first, as `parts`)
        self.row_states = [torch.zeros(num_slots, draft_rows, *t.shape[1:], dtype=t.dtype,
                                       device=self.device) for t in self.parts] \
            if draft_rows else []

    @property
    def parts(self) -> list[torch.Tensor]:
        return [*self.conv, *self.recurrent]

    def snapshot(self, slot: int) -> None:
        """Keep the slot's state as it is now (a page boundary) beside it."""
        for saved, live in zip(self.snapshots, self.parts, strict=True):
            saved[slot].copy_(live[slot])

    def snapshot_row(self, slot: int, row: int) -> None:
        """Keep the state after row `row` of the slot's last speculative step as its
        snapshot (a page boundary fell there)."""
        for saved, rows in zip(self.snapshots, self.row_states, strict=True):
            saved[slot].copy_(rows[slot, row])

    def take_back_to_row(self, slot: int, row: int) -> None:
        """The slot's state becomes the one after row `row` of its last speculative step: the
        rows after it fed drafts that were rejected."""
        for live, rows in zip(self.parts, self.row_states, strict=True):
            live[slot].copy_(rows[slot, row])

    def read_snapshot_into(self, slot: int, out: torch.Tensor) -> None:
        """The slot's snapshot as flat bytes into `out` (a host buffer of `slot_bytes`)."""
        self._flatten_into(self.snapshots, slot, out)

    @property
    def layout(self) -> tuple[StatePart, ...]:
        """The parts of one slot's flat state (what `read` copies out), in order."""
        return tuple(StatePart(tuple(t.shape[1:]), t.dtype) for t in self.parts)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's state across the layers (what a swap copies beside pages)."""
        return sum(t[0].numel() * t.element_size() for t in (*self.conv, *self.recurrent))

    @property
    def total_bytes(self) -> int:
        """The slots, their snapshots and their draft rows' states."""
        copies = 1 + (1 if self.snapshots else 0) + self.draft_rows
        return self.slot_bytes * self.num_slots * copies

    def step_states(self, chunks: tuple[StateChunk, ...]) -> StepStates:
        layers = len(self.conv)
        return StepStates(self.conv, self.recurrent, chunks, self.row_states[:layers],
                          self.row_states[layers:])

    def read(self, slot: int) -> torch.Tensor:
        """A copy of the slot's state on the CPU as one flat byte tensor."""
        out = torch.empty(self.slot_bytes, dtype=torch.uint8)
        self.read_into(slot, out)
        return out

    def read_into(self, slot: int, out: torch.Tensor) -> None:
        """Copy the slot's state into `out`, a flat uint8 host buffer of `slot_bytes`."""
        self._flatten_into(self.parts, slot, out)

    def _flatten_into(self, parts: list[torch.Tensor], slot: int, out: torch.Tensor) -> None:
        assert out.dtype == torch.uint8 and out.numel() == self.slot_bytes
        at = 0
        for t in parts:
            size = t[slot].numel() * t.element_size()
            out[at:at + size].copy_(t[slot].view(torch.uint8).reshape(-1))
            at += size

    def write(self, slot: int, saved: torch.Tensor) -> None:
        """Put back a state `read` returned, byte for byte."""
        assert saved.numel() == self.slot_bytes, "a state of another shape"
        at = 0
        for t in (*self.conv, *self.recurrent):
            size = t[slot].numel() * t.element_size()
            part = saved[at:at + size].to(self.device)
            t[slot].view(torch.uint8).reshape(-1).copy_(part)
            at += size

    def clear(self, slot: int) -> None:
        """The slot holds nothing now (a park gave it up)."""
        for t in (*self.conv, *self.recurrent):
            t[slot].zero_()
