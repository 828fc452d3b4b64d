"""The disk tier's writer thread (issue 42, first step): pages handed over as CPU tensors (the
caller's own copies: values, never the pool's buffers) are published by `DiskPageStore` off the
engine thread, and the folder is trimmed to its size as it grows. A full queue drops a page
(counted): the disk tier is a cache, and the engine never waits on a disk."""

from __future__ import annotations

import queue
import threading

import torch

from .disk_store import DiskPageStore

TRIM_EVERY = 64  # pages written between two trims (a trim lists the folder)

Item = tuple[bytes, torch.Tensor] | threading.Event  # a page, or a marker `flush` waits for


class DiskWriter:
    def __init__(self, store: DiskPageStore, max_pending: int = 4096) -> None:
        self.store = store
        self.num_dropped = 0  # pages the full queue turned away
        self._queue: queue.Queue[Item] = queue.Queue(max_pending)
        self._since_trim = 0
        self._thread = threading.Thread(target=self._run, name="kvpark-disk-writer",
                                        daemon=True)
        self._thread.start()

    def put(self, page_hash: bytes, kv: torch.Tensor) -> bool:
        """Queue one page for writing; False when the queue is full (the page is dropped)."""
        try:
            self._queue.put_nowait((page_hash, kv))
        except queue.Full:
            self.num_dropped += 1
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before is written (a shutdown write-out's end); False
        when `timeout` seconds passed first."""
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self.store.write(*item):
                self._since_trim += 1
            if self._since_trim >= TRIM_EVERY:
                self._since_trim = 0
                self.store.trim()
