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

Where they live: first in the pool's own memory (`--ctx-checkpoints` per slot, beside the state
slots, on the model's device; no budget touches them), and when those are full the least
recently used moves to host RAM under the `--preempt-ram` budget, where the least recently used
is dropped first and a park that needs the bytes takes them before it falls through to recompute.
So `--preempt-ram 0` still keeps a hybrid's prefix cache usable, and a large budget keeps more.
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
    moved_to_host: int = 0  # out of the pool's checkpoint slots, for a newer one


class CheckpointStore:
    def __init__(self, host: HostStore, slot_bytes: int, pool_slots: int = 0,
                 device: torch.device | str = "cpu") -> None:
        """`pool_slots`: checkpoints the pool's memory holds (`--ctx-checkpoints` x slots)."""
        self.host = host
        self.slot_bytes = slot_bytes
        self.pool_area = torch.empty(pool_slots, slot_bytes, dtype=torch.uint8, device=device)
        self._free_rows = list(range(pool_slots))
        self._in_pool: OrderedDict[bytes, int] = OrderedDict()  # key -> row, LRU first
        self._on_host: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU first
        self.stats = CheckpointStats()
        self._scratch = torch.empty(slot_bytes, dtype=torch.uint8)  # a snapshot on its way in

    def scratch(self) -> torch.Tensor:
        return self._scratch

    def __len__(self) -> int:
        return len(self._in_pool) + len(self._on_host)

    @property
    def num_in_pool(self) -> int:
        return len(self._in_pool)

    @property
    def bytes(self) -> int:
        """Host bytes they hold (what counts against the budget)."""
        return len(self._on_host) * self.host.charged_bytes(self.slot_bytes)

    @property
    def pool_bytes(self) -> int:
        """The pool memory set aside for them (used or not)."""
        return self.pool_area.numel()

    def has(self, key: bytes) -> bool:
        return key in self._in_pool or key in self._on_host

    def put(self, key: bytes, state: torch.Tensor) -> bool:
        """Keep a copy of `state` (flat bytes of one state slot) under `key`: in the pool's
        slots, the least recently used there moving to host RAM (or dropped) for it; without
        pool slots in host RAM, older ones making room. False where neither can hold it."""
        if self.has(key):
            self.get(key)
            return True
        if self.pool_area.shape[0]:
            if not self._free_rows:
                self._move_oldest_to_host()
            row = self._free_rows.pop()
            self.pool_area[row].copy_(state)
            self._in_pool[key] = row
        elif not self._put_on_host(key, state):
            return False
        self.stats.saved += 1
        return True

    def _move_oldest_to_host(self) -> None:
        key, row = self._in_pool.popitem(last=False)
        if self._put_on_host(key, self.pool_area[row]):
            self.stats.moved_to_host += 1
        else:
            self.stats.evictions += 1
        self._free_rows.append(row)

    def _put_on_host(self, key: bytes, state: torch.Tensor) -> bool:
        cost = self.host.charged_bytes(self.slot_bytes)
        while self._on_host and not self.host.can_hold(cost):
            self.drop_oldest()
        if not self.host.can_hold(cost):
            return False
        try:
            buffer = self.host.allocate((self.slot_bytes,), torch.uint8)
        except HostAllocationError:
            return False
        buffer.copy_(state)
        self._on_host[key] = buffer
        return True

    def saved(self) -> list[tuple[bytes, torch.Tensor]]:
        """Every checkpoint (key, state bytes), in the pool's memory and in host RAM."""
        return [*((key, self.pool_area[row]) for key, row in self._in_pool.items()),
                *self._on_host.items()]

    def get(self, key: bytes) -> torch.Tensor:
        """The saved state (marked recently used): a row of the pool's area or a host buffer."""
        if key in self._in_pool:
            self._in_pool.move_to_end(key)
            return self.pool_area[self._in_pool[key]]
        self._on_host.move_to_end(key)
        return self._on_host[key]

    def drop(self, key: bytes) -> None:
        """Forget the checkpoint under `key` (its page is gone: nothing can resume from it)."""
        row = self._in_pool.pop(key, None)
        if row is not None:
            self._free_rows.append(row)
        buffer = self._on_host.pop(key, None)
        if buffer is not None:
            self.host.release(buffer)

    def drop_oldest(self) -> None:
        """Drop the least recently used checkpoint in host RAM."""
        _, buffer = self._on_host.popitem(last=False)
        self.host.release(buffer)
        self.stats.evictions += 1

    def reclaim(self, num_bytes: int) -> None:
        """Drop host checkpoints until `num_bytes` more fit the budget (a park wins over them)."""
        while self._on_host and not self.host.can_hold(num_bytes):
            self.drop_oldest()
