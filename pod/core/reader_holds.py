"""A client that stops reading its stream costs nobody else: its sequences are parked until it
catches up (the HTTP side decides when: `http/stream.py` counts the events it has not taken).

A park here is an ordinary park (swap or recompute by the budget rule, exact either way) that
the restore loop leaves alone while `for_reader` is set; a sequence the pool had parked already
just stays parked. Letting go clears the mark, and the restore loop brings the sequence back as
room allows, in its usual order.
"""

from __future__ import annotations

from collections.abc import Collection

from .scheduler import Scheduler
from .sequence import Phase


def hold(scheduler: Scheduler, request_ids: Collection[str]) -> None:
    """Park these requests' running sequences (and keep parked ones parked) for their reader."""
    for seq in scheduler.active:
        if seq.request_id not in request_ids or seq.parking.for_reader:
            continue
        if seq.phase is Phase.RUNNING and not seq.in_prompt:
            scheduler.park(seq)
            scheduler.stats.n_reader_parks += 1
        seq.parking.for_reader = seq.phase is Phase.PARKED


def let_go(scheduler: Scheduler, request_ids: Collection[str]) -> None:
    """Their reader caught up: the restore loop may bring them back."""
    for seq in scheduler.active:
        if seq.request_id in request_ids:
            seq.parking.for_reader = False
