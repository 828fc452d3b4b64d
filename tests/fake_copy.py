"""A copy engine for CPU tests of asynchronous parks (a plain module: `conftest` names clash)."""

import torch

from kvpark.kernels.kv_copy import (
    CopyEngine,
    CopyKind,
    PagePool,
    Ticket,
    copy_in,
    copy_out,
    load_pages,
    save_pages,
)


class FakeCopyEngine(CopyEngine):
    """For CPU tests: a ticket stays in flight until `complete(ticket)`.

    With a pool, completing a ticket performs the real (synchronous) copy, so bytes appear
    exactly when the ticket completes; without one it only tracks tickets.
    """

    def __init__(self, pool: PagePool | None = None) -> None:
        self.pool = pool
        self.in_flight: list[Ticket] = []
        self._done: set[int] = set()
        self.saves: list[tuple[int, ...]] = []
        self.loads: list[tuple[int, ...]] = []

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        return self._start(Ticket(CopyKind.PARK, tuple(pages), host_buf))

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        return self._start(Ticket(CopyKind.RESUME, tuple(pages), host_buf))

    def complete(self, ticket: Ticket) -> None:
        assert ticket in self.in_flight, f"ticket {ticket.id} is not in flight"
        self.in_flight.remove(ticket)
        if self.pool is not None:
            copy = copy_out if ticket.kind is CopyKind.PARK else copy_in
            copy(self.pool, list(ticket.pages), ticket.host_buf)
        self._done.add(ticket.id)

    def poll(self, ticket: Ticket) -> bool:
        return ticket.id in self._done

    def wait(self, ticket: Ticket) -> None:
        # a real wait would block forever: the test forgot to complete the ticket
        assert self.poll(ticket), f"ticket {ticket.id} waited on but never completed"

    def save(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        # the host tier's copies are ordered, never in flight from the host's point of view
        self.saves.append(tuple(pages))
        if self.pool is not None:
            save_pages(self.pool, pages, host_pages)

    def load(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        self.loads.append(tuple(pages))
        if self.pool is not None:
            load_pages(self.pool, pages, host_pages)

    def _start(self, ticket: Ticket) -> Ticket:
        self.in_flight.append(ticket)
        return ticket
