"""The disk tier: the prefix cache's third tier, after the pool and host RAM (`--cache-disk`).

Every full page the pool registers is written through to disk off the step (`DiskWriter`), so a
page is on disk long before the pool or the host tier gives it up, and a server sharing the
folder (or this one after a restart) finds it by its chained hash. A prefix the pool and the
host tier miss is read back from here (`DiskPageStore` checks every file) into fresh pool pages.
At shutdown (`write_out`) what the disk still lacks (pages the writer's full queue turned away)
is written within a deadline and the rest given up, with one closing log line.

Pages are values on their way out: the pool hands over CPU copies (`KVPool.read_pages`), never
its buffers, so the writer thread shares nothing with a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from .disk_store import DiskPageStore
from .disk_writer import DiskWriter

log = logging.getLogger("kvpark.disk")

MIB = 1 << 20
WRITE_OUT_BATCH = 64  # pages read from the pool at once during the shutdown write-out
# seconds one lookup may spend reading pages on the engine thread (a slow network volume)
READ_BUDGET_S = 1.0
KNOWN_AT_LEAST = 4096  # hashes remembered as on disk, at least (else twice what the size holds)


@dataclass
class DiskTierStats:
    """The engine thread's counters (the store's own count writes, reads and rejections)."""

    lookups: int = 0  # pages looked up after the pool and host RAM missed them
    state_hits: int = 0  # a hybrid's state checkpoints read back
    slow_reads: int = 0  # lookups cut short by READ_BUDGET_S
    queued: int = 0  # pages handed to the writer
    dropped: int = 0  # pages the writer's full queue turned away
    write_out_pages: int = 0  # pages written at the latest shutdown
    write_out_bytes: int = 0
    write_out_dropped: int = 0  # pages given up there for lack of time


@dataclass(frozen=True)
class WriteOut:
    """What the shutdown write-out kept and gave up."""

    pages: int
    bytes: int
    dropped: int
    seconds: float


class DiskTier:
    def __init__(self, store: DiskPageStore, writer: DiskWriter,
                 states: DiskPageStore | None = None) -> None:
        """`states`: a hybrid model's state checkpoints, a second store on the same folder."""
        self.store = store
        self.writer = writer
        self.states = states
        self.stats = DiskTierStats()
        # hashes on disk as far as this server knows (written, queued or read here): not
        # offered again. A page another server evicts stays "known" until it is looked up.
        self._known: set[bytes] = set()
        self._known_states: set[bytes] = set()
        self._max_known = max(KNOWN_AT_LEAST, 2 * store.max_bytes // store.file_bytes)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return self.store.page_shape

    def lacks(self, h: bytes) -> bool:
        return h not in self._known

    # ---- writing -----------------------------------------------------------------------------
    def offer(self, hashes: list[bytes], kv: torch.Tensor) -> None:
        """Queue pages for writing: `kv` [layers, pages, 2, page_size, Hkv, D] a CPU copy of
        the pages under `hashes` (the pool's `read_pages`)."""
        per_page = kv.transpose(0, 1).contiguous()  # [pages, layers, ...]: each page one block
        for h, page in zip(hashes, per_page, strict=True):
            self._queue(h, page)

    def _queue(self, h: bytes, page: torch.Tensor, timeout: float | None = None) -> bool:
        if self.writer.put(h, page, timeout):
            self._remember(h)
            self.stats.queued += 1
            return True
        self.stats.dropped += 1
        return False

    def _remember(self, h: bytes) -> None:
        # files evicted from the folder stay known until looked up: start over past a bound
        # (a forgotten page costs one copy and one `exists` when it is offered again)
        if len(self._known) >= self._max_known:
            self._known.clear()
        self._known.add(h)

    # ---- reading -----------------------------------------------------------------------------
    def read_run(self, hashes: list[bytes], limit: int,
                 budget_s: float = READ_BUDGET_S) -> list[torch.Tensor]:
        """The pages ([layers, 2, page_size, Hkv, D] each) of the longest run of `hashes` on
        disk, at most `limit`; a bad file ends the run (and is removed by the store), and so
        does `budget_s` spent reading (the step waits: a slow disk must not stall the batch
        longer; the rest is computed)."""
        run: list[torch.Tensor] = []
        started = time.monotonic()
        for h in hashes[:limit]:
            if run and time.monotonic() - started > budget_s:
                self.stats.slow_reads += 1
                break
            self.stats.lookups += 1
            kv = self.store.read(h)
            if kv is None:
                self._known.discard(h)  # evicted by someone, or refused: write it again
                break
            self._remember(h)
            run.append(kv)
        return run

    # ---- a hybrid's state checkpoints -------------------------------------------------------
    def offer_state(self, key: bytes, state: torch.Tensor, timeout: float | None = None
                    ) -> bool:
        """Queue a hybrid's state checkpoint (flat bytes of a state slot) under the hash of
        the page it ends at; copied here: the caller's buffer is reused."""
        if self.states is None or key in self._known_states:
            return False
        if not self.writer.put(key, state.clone(), timeout, store=self.states):
            self.stats.dropped += 1
            return False
        if len(self._known_states) >= self._max_known:
            self._known_states.clear()
        self._known_states.add(key)
        self.stats.queued += 1
        return True

    def has_state(self, key: bytes) -> bool:
        """A state checkpoint file under `key` exists (checked when it is read)."""
        return self.states is not None and (key in self._known_states
                                            or self.states.contains(key))

    def read_state(self, key: bytes) -> torch.Tensor | None:
        """The checkpoint's bytes if a good file holds them (a bad one is removed)."""
        state = self.states.read(key) if self.states is not None else None
        if state is None:
            self._known_states.discard(key)
        else:
            self._known_states.add(key)
        return state

    # ---- shutdown ----------------------------------------------------------------------------
    def write_out(self, pages: Iterable[tuple[list[bytes], Callable[[], torch.Tensor]]],
                  states: Iterable[tuple[bytes, torch.Tensor]], deadline: float) -> WriteOut:
        """Write what the disk lacks from `pages` (hashes, and how to read their pages as
        `offer` takes them) and `states` (a hybrid's checkpoints), then wait for the writer,
        all by `deadline` (time.monotonic); what is left then is given up. Logs one line
        saying what was kept and dropped."""
        started, files = time.monotonic(), self.store.stats
        before, before_bytes = files.writes, files.write_bytes
        not_queued = 0  # time ran out before they were handed to the writer
        for hashes, read in pages:
            if hashes and time.monotonic() < deadline:
                not_queued += self._write_out_batch(hashes, read(), deadline)
            else:
                not_queued += len(hashes)
        for key, state in states:
            wait = deadline - time.monotonic()
            if key not in self._known_states and not (wait > 0
                                                      and self.offer_state(key, state, wait)):
                not_queued += 1
        done = self.writer.flush(max(0.0, deadline - time.monotonic()))
        left = not_queued + (0 if done else self.writer.abandon())
        result = WriteOut(files.writes - before, files.write_bytes - before_bytes, left,
                          time.monotonic() - started)
        self.stats.write_out_pages += result.pages
        self.stats.write_out_bytes += result.bytes
        self.stats.write_out_dropped += result.dropped
        log.info("disk tier at shutdown: %d files (%.1f MiB) written in %.2f s, %d dropped for "
                 "lack of time%s; %s holds %.1f MiB", result.pages, result.bytes / MIB,
                 result.seconds, result.dropped,
                 "" if self.store.writable else " (the disk is full: it stopped writing)",
                 self.store.folder, self.store.stats.bytes / MIB)
        return result

    def _write_out_batch(self, hashes: list[bytes], kv: torch.Tensor, deadline: float) -> int:
        """Queue these pages, waiting for room until `deadline`; how many were not queued."""
        for i, (h, page) in enumerate(zip(hashes, kv.transpose(0, 1).contiguous(),
                                          strict=True)):
            wait = deadline - time.monotonic()
            if wait <= 0 or not self._queue(h, page, timeout=wait):
                return len(hashes) - i
        return 0
