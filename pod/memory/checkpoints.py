"""State checkpoints: the prefix cache's second half for a hybrid model.

A cached page holds the attention layers' K/V of its tokens, but a DeltaNet layer's memory of
them is one recurrent state that cannot be cut at an arbitrary token. So a cached prefix is
usable only up to a position where the state was saved: a *checkpoint*, keyed by the chained
hash of the page that ends there (the same hash the prefix cache gives that page, so a
checkpoint is found exactly when its prefix is).

Where they are taken (the scheduler's part): each slot keeps a snapshot of its state at the
sequence's latest page boundary (`StatePool.snapshot`); when the sequence finishes or is parked by
recompute, that snapshot becomes a checkpoint. A returning conversation re-sends its history,
which starts with the previous turn's tokens: it resumes from the previous turn's last page
boundary instead of token 0.

Checkpoints live in host RAM under the `--preempt-ram` budget, least recently used dropped
first; a park that needs the bytes takes them before it falls through to recompute.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .host_store import HostAllocationError, HostStore


@dataclass
class CheckpointStats:
    saved: int = 0  # checkpoints taken
    hits: int = 0  # admissions and resumes that started from one
    tokens: int = 0  # tokens those skipped (their K/V from the pool, their state from here)
    evictions: int = 0  # dropped for room


class CheckpointStore:
    def __init__(self, host: HostStore, slot_bytes: int) -> None:
        self.host = host
        self.slot_bytes = slot_bytes
        self._saved: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU first
        self.stats = CheckpointStats()
        self._scratch = torch.empty(slot_bytes, dtype=torch.uint8)  # a snapshot on its way in

    def scratch(self) -> torch.Tensor:
        return self._scratch

    def __len__(self) -> int:
        return len(self._saved)

    @property
    def bytes(self) -> int:
        return len(self._saved) * self.host.charged_bytes(self.slot_bytes)

    def has(self, key: bytes) -> bool:
        return key in self._saved

    def put(self, key: bytes, state: torch.Tensor) -> bool:
        """Keep a copy of `state` (flat bytes of one state slot) under `key`; older
        checkpoints make room. False where the budget cannot hold one."""
        if key in self._saved:
            self._saved.move_to_end(key)
            return True
        cost = self.host.charged_bytes(self.slot_bytes)
        while self._saved and not self.host.can_hold(cost):
            self.drop_oldest()
        if not self.host.can_hold(cost):
            return False
        try:
            buffer = self.host.allocate((self.slot_bytes,), torch.uint8)
        except HostAllocationError:
            return False
        buffer.copy_(state)
        self._saved[key] = buffer
        self.stats.saved += 1
        return True

    def get(self, key: bytes) -> torch.Tensor:
        """The saved state (marked recently used)."""
        self._saved.move_to_end(key)
        return self._saved[key]

    def drop(self, key: bytes) -> None:
        """Forget the checkpoint under `key` (its page is gone: nothing can resume from it)."""
        buffer = self._saved.pop(key, None)
        if buffer is not None:
            self.host.release(buffer)

    def drop_oldest(self) -> None:
        _, buffer = self._saved.popitem(last=False)
        self.host.release(buffer)
        self.stats.evictions += 1

    def reclaim(self, num_bytes: int) -> None:
        """Drop checkpoints until `num_bytes` more fit the budget (a park wins over them)."""
        while self._saved and not self.host.can_hold(num_bytes):
            self.drop_oldest()
