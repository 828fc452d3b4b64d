"""Copies in flight: which sequence's park or resume a copy belongs to, and what to give back once
it lands (CUDA copies run on their own stream; `Swapper` polls them between steps). A cancel
while a copy is in flight is honoured once it lands: nothing is freed under a running copy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvpark.kernels.kv_copy import CopyKind, Ticket


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
    """One in-flight park or resume of one sequence; `settle()` once the copy has landed."""

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
    """In-flight transfers by owner (a sequence)."""

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

    def tickets(self) -> list[Ticket]:
        return [ticket for _, ticket in self._in_flight.values()]
