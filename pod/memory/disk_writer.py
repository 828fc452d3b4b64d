"""The disk tier's writer thread: pages (and a hybrid's state checkpoints) handed over as CPU
tensors (the caller's own copies: values, never the pool's buffers) are published by
`DiskPageStore` off the engine thread, and the folder is trimmed to its size as it grows.

What waits to be written is host RAM outside the --preempt-ram budget, so the queue is held to
`max_pending_bytes`: a page that does not fit is dropped (counted), as the disk tier is a cache
and the engine never waits on a disk. Only the shutdown write-out waits for room (`timeout`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

from .disk_store import DiskPageStore

log = logging.getLogger("kvpark.disk")

TRIM_EVERY = 64  # files written between two trims (a trim lists the folder)

# a page (or a state checkpoint) for its store, or a marker `flush` waits for
Item = tuple[DiskPageStore, bytes, torch.Tensor] | threading.Event


class DiskWriter:
    def __init__(self, store: DiskPageStore, max_pending_bytes: int = 256 << 20) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.num_dropped = 0  # pages the full queue turned away
        self.num_failed = 0  # pages whose write raised (logged once)
        self._items: deque[Item] = deque()
        self._pending_bytes = 0
        self._cond = threading.Condition()
        self._since_trim = 0
        self._thread = threading.Thread(target=self._run, name="kvpark-disk-writer",
                                        daemon=True)
        self._thread.start()

    def put(self, page_hash: bytes, kv: torch.Tensor, timeout: float | None = None,
            store: DiskPageStore | None = None) -> bool:
        """Queue one page for writing (to `store`, the writer's own by default), waiting up to
        `timeout` seconds for room (None: not at all); False when there was none (the page is
        dropped). One item always fits an empty queue, however large."""
        size = kv.nbytes
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._items and self._pending_bytes + size > self.max_pending_bytes:
                wait = 0.0 if deadline is None else deadline - time.monotonic()
                if wait <= 0:
                    self.num_dropped += 1
                    return False
                self._cond.wait(wait)
            self._items.append((store or self.store, page_hash, kv))
            self._pending_bytes += size
            self._cond.notify_all()
        return True

    @property
    def pending_bytes(self) -> int:
        """Bytes queued and not yet written (read without the lock: a metric)."""
        return self._pending_bytes

    def abandon(self) -> int:
        """Give up what is still queued (time ran out at shutdown); how many items that was."""
        with self._cond:
            given_up = [item for item in self._items if not isinstance(item, threading.Event)]
            for item in self._items:
                if isinstance(item, threading.Event):
                    item.set()
            self._items.clear()
            self._pending_bytes = 0
            self._cond.notify_all()
        return len(given_up)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before is written (a shutdown write-out's end); False
        when `timeout` seconds passed first."""
        marker = threading.Event()
        with self._cond:
            self._items.append(marker)
            self._cond.notify_all()
        return marker.wait(timeout)

    def _next(self) -> Item:
        with self._cond:
            while not self._items:
                self._cond.wait()
            return self._items[0]  # left queued while written: `pending_bytes` still counts it

    def _done(self, item: Item) -> None:
        with self._cond:
            if self._items and self._items[0] is item:  # not abandoned meanwhile
                self._items.popleft()
                if not isinstance(item, threading.Event):
                    self._pending_bytes -= item[2].nbytes
            self._cond.notify_all()

    def _run(self) -> None:
        self.store.trim()  # the folder as found: counted, and held to this server's size
        while True:
            item = self._next()
            if isinstance(item, threading.Event):
                self._done(item)
                item.set()
                continue
            store, page_hash, kv = item
            try:
                if store.write(page_hash, kv):
                    self._since_trim += 1
            except Exception:  # a bug must not stop the thread: the queue would only fill
                self.num_failed += 1
                if self.num_failed == 1:
                    log.exception("disk tier: writing a page failed")
            self._done(item)
            if self._since_trim >= TRIM_EVERY:
                self._since_trim = 0
                self.store.trim()
