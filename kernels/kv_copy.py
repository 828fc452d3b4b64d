"""Moving whole KV pages between the pool and host RAM, synchronously or in the background.

A copy engine starts a park (pool pages -> host buffer) or a resume (host buffer -> pool pages)
and hands back a `Ticket`; `poll` says whether the bytes have landed, `wait` blocks until they
have. `SyncCopyEngine` finishes before it returns (what `KVPool.gather`/`scatter` do today);
`CudaAsyncCopyEngine` runs the copies on a separate CUDA stream into pinned buffers, so decoding
of other slots goes on meanwhile; `FakeCopyEngine` finishes a ticket only when a test says so.

`ParkTransfer` / `TransferTracker` are the pure bookkeeping a scheduler needs around an
asynchronous copy: while it is in flight the sequence's device pages and host buffer stay
held; a cancel during the copy is honoured only once the copy has completed.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

ASYNC_ENV = "KVPARK_PREEMPT_ASYNC"  # "0" forces the synchronous path on CUDA

_ticket_ids = itertools.count()


class PagePool(Protocol):
    """What the engines need of `kvpark.pod.kv_pool.KVPool` (kernels never import pod/)."""

    caches: list[torch.Tensor]
    device: torch.device

    def gather(self, pages: list[int], out: torch.Tensor) -> None: ...

    def scatter(self, pages: list[int], src: torch.Tensor) -> None: ...


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

    @property
    def is_async(self) -> bool:
        return False


class SyncCopyEngine(CopyEngine):
    """The copy is complete when `start_*` returns."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        self.pool.gather(pages, host_buf)
        self._settle()
        return Ticket(CopyKind.PARK, tuple(pages), host_buf)

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        self.pool.scatter(pages, host_buf)
        self._settle()
        return Ticket(CopyKind.RESUME, tuple(pages), host_buf)

    def poll(self, ticket: Ticket) -> bool:
        return True

    def wait(self, ticket: Ticket) -> None:
        return None

    def _settle(self) -> None:
        # gather into pinned memory is non_blocking: "done" must mean the bytes are on the host
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()


class CudaAsyncCopyEngine(CopyEngine):
    """Copies on their own CUDA stream, ordered after the compute work already queued."""

    def __init__(self, pool: PagePool) -> None:
        assert pool.device.type == "cuda", f"async copies need a CUDA pool, got {pool.device}"
        self.pool = pool
        self.stream = torch.cuda.Stream(device=pool.device)

    @property
    def is_async(self) -> bool:
        return True

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        assert host_buf.is_pinned(), "an async park needs a pinned host buffer"
        with self._on_copy_stream():
            span, index = _page_span(pages), _page_index(pages, self.pool.device)
            for layer, cache in enumerate(self.pool.caches):
                pages_kv = cache[span] if span is not None else cache.index_select(0, index)
                host_buf[layer].copy_(pages_kv, non_blocking=True)
        return self._ticket(CopyKind.PARK, pages, host_buf)

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        assert host_buf.is_pinned(), "an async resume needs a pinned host buffer"
        with self._on_copy_stream():
            span, index = _page_span(pages), _page_index(pages, self.pool.device)
            for layer, cache in enumerate(self.pool.caches):
                if span is not None:
                    cache[span].copy_(host_buf[layer], non_blocking=True)
                else:
                    staged = host_buf[layer].to(self.pool.device, non_blocking=True)
                    cache.index_copy_(0, index, staged)
        return self._ticket(CopyKind.RESUME, pages, host_buf)

    def poll(self, ticket: Ticket) -> bool:
        return ticket.event.query()

    def wait(self, ticket: Ticket) -> None:
        ticket.event.synchronize()

    def _on_copy_stream(self) -> torch.cuda.StreamContext:
        # a park reads K/V the last queued step may still be writing; a resume writes pages
        # whose previous owner's last step may still be reading them
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        return torch.cuda.stream(self.stream)

    def _ticket(self, kind: CopyKind, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        event = torch.cuda.Event()
        event.record(self.stream)
        return Ticket(kind, tuple(pages), host_buf, event=event)


class FakeCopyEngine(CopyEngine):
    """For CPU tests: a ticket stays in flight until `complete(ticket)`.

    With a pool, completing a ticket performs the real (synchronous) copy, so bytes appear
    exactly when the ticket completes; without one it only tracks tickets.
    """

    def __init__(self, pool: PagePool | None = None) -> None:
        self.pool = pool
        self.in_flight: list[Ticket] = []
        self._done: set[int] = set()

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        return self._start(Ticket(CopyKind.PARK, tuple(pages), host_buf))

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        return self._start(Ticket(CopyKind.RESUME, tuple(pages), host_buf))

    def complete(self, ticket: Ticket) -> None:
        assert ticket in self.in_flight, f"ticket {ticket.id} is not in flight"
        self.in_flight.remove(ticket)
        if self.pool is not None:
            copy = self.pool.gather if ticket.kind is CopyKind.PARK else self.pool.scatter
            copy(list(ticket.pages), ticket.host_buf)
        self._done.add(ticket.id)

    def poll(self, ticket: Ticket) -> bool:
        return ticket.id in self._done

    def wait(self, ticket: Ticket) -> None:
        # a real wait would block forever: the test forgot to complete the ticket
        assert self.poll(ticket), f"ticket {ticket.id} waited on but never completed"

    def _start(self, ticket: Ticket) -> Ticket:
        self.in_flight.append(ticket)
        return ticket


def make_copy_engine(pool: PagePool, env: Mapping[str, str] | None = None) -> CopyEngine:
    """Async on CUDA unless KVPARK_PREEMPT_ASYNC=0; synchronous on the CPU."""
    env = os.environ if env is None else env
    if pool.device.type == "cuda" and env.get(ASYNC_ENV, "1") != "0":
        return CudaAsyncCopyEngine(pool)
    return SyncCopyEngine(pool)


def _page_span(pages: list[int]) -> slice | None:
    # consecutive pages (the pool hands out low ids first) are copied through a view: no
    # gather kernel and no device staging buffer
    if all(b == a + 1 for a, b in zip(pages, pages[1:])):
        return slice(pages[0], pages[-1] + 1)
    return None


def _page_index(pages: list[int], device: torch.device) -> torch.Tensor | None:
    if _page_span(pages) is not None:
        return None
    return torch.tensor(pages, dtype=torch.long).to(device, non_blocking=True)


# ---- the state machine a scheduler keeps around asynchronous copies ------------------------------
class Outcome(str, enum.Enum):
    PARKED = "parked"  # park landed: the sequence is parked by swap
    RESUMED = "resumed"  # resume landed: the sequence may run
    CANCELLED = "cancelled"  # cancelled mid-copy: everything it held is given back


@dataclass(frozen=True)
class Release:
    """What to give back once a copy has landed."""

    outcome: Outcome
    free_pages: tuple[int, ...]  # device pages back to the pool
    release_host: bool  # the host buffer back to the host store


@dataclass(eq=False)
class ParkTransfer:
    """One in-flight park or resume of one sequence.

    While in flight, the device pages stay allocated (a park still reads them; a resume is
    writing them) and the host buffer stays charged. `settle()` is called once the copy has
    landed and says what may be given back.
    """

    kind: CopyKind
    pages: tuple[int, ...]
    cancelled: bool = False
    settled: bool = False

    def cancel(self) -> None:
        assert not self.settled, "cancelling a transfer that has already settled"
        self.cancelled = True

    def settle(self) -> Release:
        assert not self.settled, "a transfer settles once"
        self.settled = True
        if self.cancelled:
            return Release(Outcome.CANCELLED, self.pages, release_host=True)
        if self.kind is CopyKind.PARK:
            return Release(Outcome.PARKED, self.pages, release_host=False)
        return Release(Outcome.RESUMED, (), release_host=True)


class TransferTracker:
    """In-flight transfers by owner (a sequence). A busy owner is neither scheduled nor chosen."""

    def __init__(self) -> None:
        self._in_flight: dict[Hashable, tuple[ParkTransfer, Ticket]] = {}

    def __len__(self) -> int:
        return len(self._in_flight)

    def start(self, owner: Hashable, ticket: Ticket) -> ParkTransfer:
        assert owner not in self._in_flight, f"{owner!r} already has a copy in flight"
        transfer = ParkTransfer(ticket.kind, ticket.pages)
        self._in_flight[owner] = (transfer, ticket)
        return transfer

    def is_busy(self, owner: Hashable) -> bool:
        return owner in self._in_flight

    def cancel(self, owner: Hashable) -> bool:
        """Mark the owner's copy cancelled; True when one is in flight (free nothing yet)."""
        entry = self._in_flight.get(owner)
        if entry is None:
            return False
        entry[0].cancel()
        return True

    def reap(self, poll: Callable[[Ticket], bool]) -> list[tuple[Hashable, Release, Ticket]]:
        """Settle every transfer whose copy has landed, in start order."""
        landed = [(owner, t, k) for owner, (t, k) in self._in_flight.items() if poll(k)]
        for owner, _, _ in landed:
            del self._in_flight[owner]
        return [(owner, transfer.settle(), ticket) for owner, transfer, ticket in landed]

    def pages(self) -> list[int]:
        """Device pages the transfers in flight hold."""
        return [p for transfer, _ in self._in_flight.values() for p in transfer.pages]

    def tickets(self) -> list[tuple[Hashable, Ticket]]:
        return [(owner, ticket) for owner, (_, ticket) in self._in_flight.items()]

    def drain(self, wait: Callable[[Ticket], None]) -> list[tuple[Hashable, Release, Ticket]]:
        """Wait for every copy (shutdown) and settle them all."""
        for _, ticket in self._in_flight.values():
            wait(ticket)
        return self.reap(lambda ticket: True)
