"""A hybrid model's prefix reuse, as the scheduler applies it: a cached page prefix is usable up
to the longest prefix that ends at a state checkpoint (`memory/checkpoints.py`); the pages past
it go back and the checkpoint's state goes into the sequence's slot. Pure decisions plus the
memory writes they need; the sequence's fields stay the scheduler's to write."""

from __future__ import annotations

from ..memory.checkpoints import CheckpointStore
from ..memory.kv_pool import KVPool


def usable_pages(store: CheckpointStore, hashes: list[bytes], num_pages: int) -> int:
    """The most leading pages (at most `num_pages`) whose end has a checkpoint; 0 if none."""
    for k in range(min(num_pages, len(hashes)), 0, -1):
        if store.has(hashes[k - 1]):
            return k
    return 0


def cut_to_checkpoint(pool: KVPool, store: CheckpointStore, slot: int, hashes: list[bytes],
                      pages: list[int]) -> list[int]:
    """Keep the pages up to the latest checkpoint (its state written into `slot`), give the
    rest back; returns the pages kept."""
    keep = usable_pages(store, hashes, len(pages))
    pool.free(pages[keep:])
    if keep:
        pool.states.write(slot, store.get(hashes[keep - 1]))
        pool.states.snapshot(slot)  # the slot's snapshot is this state now, not a former one's
        store.stats.hits += 1
        store.stats.tokens += keep * pool.page_size
    return pages[:keep]


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
