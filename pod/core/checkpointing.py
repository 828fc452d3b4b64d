"""A hybrid model's prefix reuse, as the scheduler applies it: a cached page prefix is usable up
to the longest prefix that ends at a state checkpoint (`memory/checkpoints.py`); the pages past
it go back and the checkpoint's state goes into the sequence's slot. Pure decisions plus the
memory writes they need; the sequence's fields stay the scheduler's to write."""

from __future__ import annotations

import torch

from ..memory.checkpoints import CheckpointStore
from ..memory.disk_tier import DiskTier
from ..memory.kv_pool import KVPool


def usable_pages(store: CheckpointStore, hashes: list[bytes], num_pages: int,
                 disk: DiskTier | None = None) -> int:
    """The most leading pages (at most `num_pages`) whose end has a checkpoint (kept here, or
    a file in the disk tier); 0 if none."""
    for k in range(min(num_pages, len(hashes)), 0, -1):
        if store.has(hashes[k - 1]) or (disk is not None and disk.has_state(hashes[k - 1])):
            return k
    return 0


def cut_to_checkpoint(pool: KVPool, store: CheckpointStore, slot: int, hashes: list[bytes],
                      pages: list[int]) -> list[int]:
    """Keep the pages up to the latest checkpoint (its state written into `slot`), give the
    rest back; returns the pages kept. A checkpoint only the disk tier has is read back (and
    kept here again); a bad file is removed and the next earlier checkpoint tried."""
    keep = len(pages)
    while (keep := usable_pages(store, hashes, keep, pool.disk)) > 0:
        state = checkpoint_state(pool, store, hashes[keep - 1])
        if state is not None:
            pool.states.write(slot, state)
            pool.states.snapshot(slot)  # the slot's snapshot is this state now, not a former one
            store.stats.hits += 1
            store.stats.tokens += keep * pool.page_size
            break
        keep -= 1
    pool.free(pages[keep:])
    return pages[:keep]


def checkpoint_state(pool: KVPool, store: CheckpointStore, key: bytes) -> torch.Tensor | None:
    """The checkpoint under `key`: kept here, or read from the disk tier and kept here again
    (None: its file was bad)."""
    if store.has(key):
        return store.get(key)
    state = pool.disk.read_state(key)
    if state is not None:
        pool.disk.stats.state_hits += 1
        store.put(key, state)
    return state


def snapshot(pool: KVPool, slot: int, state_row: int | None) -> None:
    """Keep the slot's state at a page boundary as its snapshot: the live state, or the one a
    speculative chunk kept after row `state_row` (the step went further than the boundary)."""
    if state_row is None:
        pool.states.snapshot(slot)
    else:
        pool.states.snapshot_row(slot, state_row)


def offer(pool: KVPool, store: CheckpointStore, slot: int, checkpoint_at: int,
          hashes: list[bytes]) -> None:
    """The slot's snapshot (the state at token `checkpoint_at`, a page boundary) kept as the
    checkpoint of the page that ends there, if that page is hashed."""
    num_pages = checkpoint_at // pool.page_size
    if num_pages == 0 or len(hashes) < num_pages or store.has(hashes[num_pages - 1]):
        return
    state = store.scratch()
    pool.states.read_snapshot_into(slot, state)
    store.put(hashes[num_pages - 1], state)
    if pool.disk is not None:
        pool.disk.offer_state(hashes[num_pages - 1], state)
