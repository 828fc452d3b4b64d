"""What each slot last ran, and its save / restore / erase over the pool (engine thread only).

An idle slot holds no KV in kvpark: a finished sequence gives its pages back, and its full pages
live on in the prefix cache under chained hashes until evicted. So a slot's saveable state is
the last sequence it ran, as far as its whole pages are still cached: their tokens (prompt and
generated), the prompt's length among them (the hashes tell prompt rows from generated ones
where those differ) and the pages' bytes. The last partial page is not kept by the cache and is
not saved: a request continuing the conversation computes it again, as it would had the server
never saved. Restoring puts the pages back as cached pages under the same hashes, as if that
sequence had just finished, so the next prompt that starts with those tokens shares them.

A hybrid model's cached pages are usable only up to a state checkpoint (`core/checkpointing.py`),
so its file ends at the latest page with one and carries that checkpoint; a restore puts it back
among the checkpoints, where the next turn of the conversation finds it as it finds the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.budget import MIB
from ..memory.kv_pool import KVPool
from ..memory.slot_files import SlotState
from .checkpointing import usable_pages
from .sequence import Sequence


@dataclass(frozen=True)
class SlotRecord:
    tokens: tuple[int, ...]  # of the full pages it hashed: len == len(hashes) x page size
    num_prompt: int
    hashes: tuple[bytes, ...]


class SlotMemory:
    def __init__(self, pool: KVPool, num_slots: int) -> None:
        self.pool = pool
        self.records: list[SlotRecord | None] = [None] * num_slots

    def remember(self, seq: Sequence) -> None:
        """A sequence finished (the scheduler's on_finish): it is its slot's last one now."""
        if seq.slot_id is None or self.pool.cache is None:
            return
        hashes = tuple(seq.page_hashes)
        tokens = tuple(seq.tokens[:len(hashes) * self.pool.page_size])
        self.records[seq.slot_id] = SlotRecord(tokens, min(seq.num_prompt, len(tokens)), hashes)

    @property
    def why_not(self) -> str | None:
        """Why slot files cannot work on this pool, or None."""
        if self.pool.cache is None:
            return "slot files need the prefix cache (the server runs with --no-prefix-cache)"
        return None

    def export(self, slot_id: int) -> SlotState | str:
        """The slot's state with a copy of its pages, or why there is none. A hybrid model's
        pages are saved up to the latest one its state checkpoint ends (the state cannot be cut
        anywhere else), with that checkpoint."""
        if self.why_not:
            return self.why_not
        record = self.records[slot_id]
        pages = self.pool.cache.lookup(record.hashes) if record else []  # still cached, in order
        checkpoints = self.pool.checkpoints
        if checkpoints is not None:
            pages = pages[:usable_pages(checkpoints, list(record.hashes), len(pages))]
        if not pages:
            kept = " with a state checkpoint" if checkpoints is not None else ""
            return f"slot {slot_id} holds nothing to save (no finished sequence whose pages " \
                   f"are still cached{kept})"
        num_tokens = len(pages) * self.pool.page_size
        state = None if checkpoints is None else checkpoints.get(record.hashes[len(pages) - 1])
        return SlotState(record.tokens[:num_tokens], min(record.num_prompt, num_tokens),
                         self.pool.read_pages(pages),
                         None if state is None else state.to("cpu", copy=True))

    def restore(self, slot_id: int, state: SlotState) -> str | None:
        """Put the state's pages into the prefix cache (and a hybrid's state checkpoint beside
        them); why not, or None. All or nothing: when the pool (free and cached pages) cannot
        take the missing pages, or the budget the checkpoint, nothing is left behind."""
        cache = self.pool.cache
        if self.why_not:
            return self.why_not
        hashes = cache.grow_hashes([], state.tokens, state.num_prompt, state.num_pages)
        checkpoints = self.pool.checkpoints
        assert (checkpoints is None) == (state.state is None), "the file's layout was checked"
        added = checkpoints is not None and not checkpoints.has(hashes[-1])
        if checkpoints is not None and not checkpoints.put(hashes[-1], state.state):
            return (f"the --preempt-ram budget cannot hold the file's state checkpoint "
                    f"({state.state_bytes / MIB:.1f} MiB) now; retry when fewer are parked")
        if not self.pool.insert_cached(hashes, state.kv):
            if added:
                checkpoints.drop(hashes[-1])
            return (f"the KV pool cannot take the file's {state.num_pages} pages now (free and "
                    f"cached: {self.pool.num_free_pages}); retry when fewer requests run")
        self.records[slot_id] = SlotRecord(state.tokens, state.num_prompt, tuple(hashes))
        return None

    def erase(self, slot_id: int) -> int:
        """Forget the slot's last sequence and drop its cached pages (and their checkpoints)
        that nobody holds and no other slot remembers; the tokens it remembered."""
        record, self.records[slot_id] = self.records[slot_id], None
        if record is None or self.pool.cache is None:
            return 0
        kept = {h for other in self.records if other is not None for h in other.hashes}
        dropped = [h for h in record.hashes if h not in kept]
        pages = [self.pool.cache.find(h) for h in dropped]
        self.pool.drop_cached([p for p in pages if p is not None])
        if self.pool.checkpoints is not None:  # a page a sequence still holds keeps its own
            for h in dropped:
                if self.pool.cache.find(h) is None:
                    self.pool.checkpoints.drop(h)
        return len(record.tokens)
