"""Moving whole KV pages between the pool and host RAM, synchronously or in the background.

A copy engine starts a park (pool pages -> host buffer) or a resume (host buffer -> pool pages)
and hands back a `Ticket`; `poll` says whether the bytes have landed, `wait` blocks until they
have. `SyncCopyEngine` finishes before it returns; `CudaAsyncCopyEngine` runs the copies on a
separate CUDA stream into pinned buffers, so decoding of other slots goes on meanwhile. Both
move bytes with the one `copy_out` / `copy_in`. Which sequence a copy belongs to, and what to
give back when it lands, is the serving side's business (`kvpark.pod.core.swap`).

The host tier of the prefix cache keeps pages one by one (each `[layers, 2, ps, Hkv, D]`, so one
can be dropped alone): `save` and `load` move such pages and are *ordered*, not waited on: work
queued after them (a step overwriting a saved page, a step reading a loaded one) runs after the
copy. On the CPU that is a plain copy; on CUDA the copy runs on the copy stream and the compute
stream waits for it there, so the host thread never stalls.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import itertools
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import worker_pool
from .cbuild import library_or_none

log = logging.getLogger(__name__)
_ticket_ids = itertools.count()


class PagePool(Protocol):
    """What the engines need of `kvpark.pod.memory.kv_pool.KVPool` (kernels never import pod/)."""

    caches: list[torch.Tensor]  # per layer: [pages, 2, page_size, Hkv, D]
    device: torch.device


def copy_out(pool: PagePool, pages: list[int], host_buf: torch.Tensor,
             non_blocking: bool = False) -> None:
    """`pages` of every layer into `host_buf` `[layers, len(pages), 2, ps, Hkv, D]`."""
    span, index = _page_span(pages), _page_index(pages, pool.device)
    for layer, cache in enumerate(pool.caches):
        pages_kv = cache[span] if span is not None else cache.index_select(0, index)
        host_buf[layer].copy_(pages_kv, non_blocking=non_blocking)


def copy_in(pool: PagePool, pages: list[int], host_buf: torch.Tensor,
            non_blocking: bool = False) -> None:
    """`host_buf` (as `copy_out` filled it) into `pages`, which may differ from the old ones."""
    span, index = _page_span(pages), _page_index(pages, pool.device)
    for layer, cache in enumerate(pool.caches):
        if span is not None:
            cache[span].copy_(host_buf[layer], non_blocking=non_blocking)
        else:
            cache.index_copy_(0, index, host_buf[layer].to(pool.device,
                                                           non_blocking=non_blocking))


def save_pages(pool: PagePool, pages: list[int], host_pages: list[torch.Tensor],
               non_blocking: bool = False) -> None:
    """Each of `pages` (every layer) into its own host tensor `[layers, 2, ps, Hkv, D]`."""
    assert len(pages) == len(host_pages), "a host page for each pool page"
    if copy_pages_in_c(pool, pages, host_pages, to_host=True):
        return
    for page, host_page in zip(pages, host_pages):
        if host_page.device == pool.device:  # the CPU: one op a page, not one a layer
            torch.stack([cache[page] for cache in pool.caches], out=host_page)
            continue
        for layer, cache in enumerate(pool.caches):
            host_page[layer].copy_(cache[page], non_blocking=non_blocking)


def load_pages(pool: PagePool, pages: list[int], host_pages: list[torch.Tensor],
               non_blocking: bool = False) -> None:
    """Host tensors (as `save_pages` filled them) into `pages`."""
    assert len(pages) == len(host_pages), "a host page for each pool page"
    if copy_pages_in_c(pool, pages, host_pages, to_host=False):
        return
    for page, host_page in zip(pages, host_pages):
        for layer, cache in enumerate(pool.caches):
            cache[page].copy_(host_page[layer], non_blocking=non_blocking)


def copy_pages_in_c(pool: PagePool, pages: list[int], host_pages: list[torch.Tensor],
                    to_host: bool) -> bool:
    """The copy in one C call (`csrc/page_copy.c`) where pool and host pages are dense CPU
    tensors of one dtype; False (nothing copied) elsewhere, or without the C kernels."""
    caches = pool.caches
    if not pages or not _c_copies_fit(caches, host_pages):
        return False
    lib = _page_copy_kernel()
    if lib is None:
        return False
    page_bytes = caches[0][0].numel() * caches[0].element_size()
    pointers = ctypes.c_void_p * max(len(caches), len(pages))
    lib.kvpark_copy_pages(pointers(*(c.data_ptr() for c in caches)), len(caches),
                          (ctypes.c_int64 * len(pages))(*pages), len(pages), page_bytes,
                          pointers(*(h.data_ptr() for h in host_pages)), int(to_host),
                          worker_pool.get_num_threads())
    return True


def _c_copies_fit(caches: list[torch.Tensor], host_pages: list[torch.Tensor]) -> bool:
    first = caches[0]
    page_shape = (len(caches), *first.shape[1:])
    return (first.device.type == "cpu"
            and all(c.is_contiguous() and c.dtype == first.dtype and c.shape == first.shape
                    for c in caches)
            and all(h.device.type == "cpu" and h.is_contiguous() and h.dtype == first.dtype
                    and h.shape == page_shape for h in host_pages))


@functools.cache
def _page_copy_kernel() -> ctypes.CDLL | None:
    lib = library_or_none(log, "host-tier page copies by torch")
    if lib is None:
        return None
    lib.kvpark_copy_pages.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int]
    lib.kvpark_copy_pages.restype = None
    return lib


class CopyKind(str, enum.Enum):
    PARK = "park"  # pool -> host
    RESUME = "resume"  # host -> pool


@dataclass(eq=False)
class Ticket:
    kind: CopyKind
    pages: tuple[int, ...]
    host_buf: torch.Tensor  # [layers, len(pages), 2, page_size, Hkv, D]
    started_at: float = field(default_factory=time.perf_counter)
    id: int = field(default_factory=lambda: next(_ticket_ids))
    event: Any = None  # torch.cuda.Event on the copy stream (async engine only)


class CopyEngine(ABC):
    @abstractmethod
    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        """Begin copying `pages` of every layer into `host_buf`."""

    @abstractmethod
    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        """Begin copying `host_buf` (as filled by a park) into `pages`."""

    @abstractmethod
    def poll(self, ticket: Ticket) -> bool:
        """True once the ticket's bytes have landed; never blocks."""

    @abstractmethod
    def wait(self, ticket: Ticket) -> None:
        """Block until the ticket's bytes have landed."""

    @abstractmethod
    def save(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        """Copy `pages` into host pages, ordered before any work queued after it."""

    @abstractmethod
    def load(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        """Copy host pages into `pages`, ordered before any work queued after it."""


class SyncCopyEngine(CopyEngine):
    """The copy is complete when `start_*` returns."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        copy_out(self.pool, pages, host_buf, non_blocking=host_buf.is_pinned())
        self._settle()
        return Ticket(CopyKind.PARK, tuple(pages), host_buf)

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        copy_in(self.pool, pages, host_buf, non_blocking=True)
        self._settle()
        return Ticket(CopyKind.RESUME, tuple(pages), host_buf)

    def poll(self, ticket: Ticket) -> bool:
        return True

    def wait(self, ticket: Ticket) -> None:
        return None

    def save(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        save_pages(self.pool, pages, host_pages,
                   non_blocking=bool(host_pages) and host_pages[0].is_pinned())
        self._settle()

    def load(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        load_pages(self.pool, pages, host_pages, non_blocking=True)
        self._settle()

    def _settle(self) -> None:
        # copies into pinned memory are non_blocking: "done" must mean the bytes are on the host
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()


class CudaAsyncCopyEngine(CopyEngine):
    """Copies on their own CUDA stream, ordered after the compute work already queued."""

    def __init__(self, pool: PagePool) -> None:
        assert pool.device.type == "cuda", f"async copies need a CUDA pool, got {pool.device}"
        self.pool = pool
        self.stream = torch.cuda.Stream(device=pool.device)

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        assert host_buf.is_pinned(), "an async park needs a pinned host buffer"
        with self._on_copy_stream():
            copy_out(self.pool, pages, host_buf, non_blocking=True)
        return self._ticket(CopyKind.PARK, pages, host_buf)

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        assert host_buf.is_pinned(), "an async resume needs a pinned host buffer"
        with self._on_copy_stream():
            copy_in(self.pool, pages, host_buf, non_blocking=True)
        return self._ticket(CopyKind.RESUME, pages, host_buf)

    def poll(self, ticket: Ticket) -> bool:
        return ticket.event.query()

    def wait(self, ticket: Ticket) -> None:
        ticket.event.synchronize()

    def save(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        with self._on_copy_stream():
            save_pages(self.pool, pages, host_pages, non_blocking=True)
        self._order_compute_after_copies()

    def load(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        with self._on_copy_stream():
            load_pages(self.pool, pages, host_pages, non_blocking=True)
        self._order_compute_after_copies()

    def _order_compute_after_copies(self) -> None:
        # the next step may overwrite a page just saved, or read one just loaded: the compute
        # stream waits for the copy stream on the device, the host thread goes on
        torch.cuda.current_stream(self.pool.device).wait_stream(self.stream)

    def _on_copy_stream(self) -> torch.cuda.StreamContext:
        # a park reads K/V the last queued step may still be writing; a resume writes pages
        # whose previous owner's last step may still be reading them
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        return torch.cuda.stream(self.stream)

    def _ticket(self, kind: CopyKind, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        event = torch.cuda.Event()
        event.record(self.stream)
        return Ticket(kind, tuple(pages), host_buf, event=event)


def make_copy_engine(pool: PagePool, async_copies: bool = True) -> CopyEngine:
    """Async on CUDA unless `async_copies` is off (--no-preempt-async); synchronous on the CPU."""
    if pool.device.type == "cuda" and async_copies:
        return CudaAsyncCopyEngine(pool)
    return SyncCopyEngine(pool)


def _page_span(pages: list[int]) -> slice | None:
    # consecutive pages (the pool hands out low ids first) are copied through a view: no
    # gather kernel and no device staging buffer
    if pages and all(b == a + 1 for a, b in zip(pages, pages[1:])):
        return slice(pages[0], pages[-1] + 1)
    return None


def _page_index(pages: list[int], device: torch.device) -> torch.Tensor | None:
    if _page_span(pages) is not None:
        return None
    return torch.tensor(pages, dtype=torch.long).to(device, non_blocking=True)
