"""Parking copies: a victim's KV pages to host RAM and back, and the state of copies in flight.

The scheduler decides who parks and who resumes; `Swapper` carries it out over the pool, the
host store and a copy engine. A swap park copies the pages into a host buffer charged to the
`--preempt-ram` budget (a refused allocation falls through to recompute); a recompute park drops
them and marks the tokens to replay. On CUDA a copy may still be in flight when `park`/`resume`
return: until it lands the sequence is busy (neither scheduled nor chosen), its device pages
stay allocated and its host buffer stays charged; a cancel mid-copy is honoured once it lands.

With a prefix cache the victim's full pages also stay in the pool as cached pages when it lets
go of them. A swap copies only the pages after its leading *resident* ones (shared with a running
sequence, e.g. an `n > 1` sibling or a common system prompt, so they stay in the pool). A resume
takes back whatever of its own pages is still cached; a swapped sequence then copies back only
the rest (its own pages only, so a swap stays exact on any device), and a recomputed one
replays only from the first page the cache lost (often just its partial last page). Should a
resident page be lost while parked (its other holders finished and it was evicted), the host
copy cannot fill the hole and the resume replays from there instead.

With a host tier (`host_tier.py`) a swap keeps its full pages there, held for it: pages the tier
has with the same bytes are not copied again, and only the partial last page goes into a buffer
of its own. Cached host pages make room for a swap before it would fall through to recompute.
A resume takes its pages from the pool first, then the tier, then its own buffer; a recompute
resume replays only what neither tier holds.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from kvpark.kernels.kv_copy import CopyEngine, SyncCopyEngine, Ticket

from ..memory.host_store import HostAllocationError, HostStore
from ..memory.host_tier import HostPage, HostTier
from ..memory.kv_pool import KVPool
from ..memory.transfers import Outcome, TransferTracker
from .sequence import PreemptMode, Sequence

log = logging.getLogger("kvpark.swap")


@dataclass
class CopyTimes:
    """Durations of swap copies, park and resume (seconds; drained by the metrics)."""

    park: list[float] = field(default_factory=list)
    resume: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class TierPart:
    """The full pages a swap keeps in the host tier, and what that costs in host bytes."""

    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    origins: list[int] = field(default_factory=list)
    new_bytes: int = 0  # for the pages the tier does not hold with the same bytes
    reclaimable_bytes: int = 0  # cached host bytes a swap may drop (not those it reuses)


@dataclass(frozen=True)
class ParkPlan:
    """One sequence's park as the memory layer sees it: the scheduler decides the mode from
    the cost (the pure policy) and hands the plan back to `Swapper.park` to carry out."""

    resident: int  # leading pages others hold too: they stay in the pool
    tiered: TierPart  # full pages the host tier keeps (a swap only)
    copied: tuple[int, ...]  # pages a swap copies into a buffer of its own
    swap_bytes: int  # host bytes a swap needs
    budget_bytes: int  # --preempt-ram
    held_bytes: int  # held now, less the cached host pages a swap may drop for room


@dataclass(frozen=True)
class ParkResult:
    mode: PreemptMode  # as carried out: SWAP or RECOMPUTE
    fell_back: bool = False  # ordered to swap, the host refused a buffer: recomputed


@dataclass(frozen=True)
class Resumed:
    """A resume carried out: the pages and counts the sequence continues with (the scheduler
    writes them)."""

    page_table: list[int]
    num_computed: int
    replay_until: int = 0  # a recompute: it replays until here (0: nothing to replay)
    copied_back: bool = False  # its swap copy came back: a draft model's lag is as it was


@dataclass(frozen=True)
class ResumeReport:
    """Where a landed resume found its K/V."""

    released_pages: int  # full pages its park released into the pool's cache
    restored_pages: int  # of those, back from a cache tier (pool; host too for a recompute)
    replay_tokens: int  # tokens it still recomputes
    sources: tuple[str, ...]  # pool, host, recompute: what /slots shows


class Swapper:
    """Parks and restores sequences' KV over the pool, the host store and a copy engine. It
    reads a sequence and keeps its park's bookkeeping (`ParkState`); the pages and counts a
    sequence continues with go back to the scheduler, their one writer."""

    def __init__(self, pool: KVPool, host: HostStore, copy: CopyEngine | None = None) -> None:
        self.pool = pool
        self.host = host
        self.copy = copy or SyncCopyEngine(pool)
        self.copy_times = CopyTimes()
        self.transfers = TransferTracker()

    @property
    def tier(self) -> HostTier | None:
        return self.pool.tier

    @property
    def num_in_flight(self) -> int:
        return len(self.transfers)

    @property
    def pages_in_flight(self) -> list[int]:
        """Pages held by copies still in flight (neither free nor in a page table)."""
        return self.transfers.pages()

    def is_busy(self, seq: Sequence) -> bool:
        return self.transfers.is_busy(seq)

    # ---- park --------------------------------------------------------------------------------
    def plan_park(self, seq: Sequence) -> ParkPlan:
        """What parking a running sequence involves and what a swap would cost the budget; the
        scheduler picks the mode (the pure policy) and hands the plan back to `park`. Its full
        pages are registered in the prefix cache already (`parking.cached_pages`: the
        scheduler's), so that they stay cached once let go."""
        resident = self._num_resident(seq)
        tiered = self._tier_part(seq, resident)
        copied = tuple(seq.page_table[resident + len(tiered.pages):])
        return ParkPlan(resident, tiered, copied,
                        swap_bytes=self.host.charged_bytes(self.pool.swap_bytes(len(copied)))
                        + self._state_charge() + tiered.new_bytes,
                        budget_bytes=self.host.budget_bytes,
                        held_bytes=self.host.held_bytes - tiered.reclaimable_bytes
                        - (self.pool.checkpoints.bytes if self.pool.checkpoints else 0))

    def park(self, seq: Sequence, plan: ParkPlan, mode: PreemptMode, wait: bool = True
             ) -> ParkResult:
        """Carry out a park the scheduler decided: swap (falling through to recompute where the
        host refuses a buffer) or recompute; the sequence's pages go back to the pool.

        With `wait=False` an asynchronous copy may still be in flight on return; its pages come
        back to the pool when it lands (`reap`).
        """
        started = time.perf_counter()
        ticket = self._start_park_copy(seq, plan) if mode is PreemptMode.SWAP else None
        self._drop_state(seq)  # saved above where it swaps
        pages = seq.page_table
        if ticket is not None:
            seq.parking.resident_pages = plan.resident
        if ticket is not None and wait:
            self.copy.wait(ticket)
        if ticket is not None and not self.copy.poll(ticket):
            self.pool.free(pages[:plan.resident + len(plan.tiered.pages)])  # tier: ordered
            self.transfers.start(seq, ticket)  # the copied pages stay allocated until it lands
        else:
            self.pool.free(pages)
            if ticket is not None:
                self.copy_times.park.append(time.perf_counter() - started)
        done = PreemptMode.SWAP if ticket is not None else PreemptMode.RECOMPUTE
        log.info("seq %s (slot %s) parked by %s: %d tokens, %d host bytes%s", seq.request_id,
                 seq.slot_id, done.value, len(seq.tokens), seq.parking.host_bytes,
                 ", copy in flight" if self.is_busy(seq) else "")
        return ParkResult(done, fell_back=mode is PreemptMode.SWAP and ticket is None)

    def resume_report(self, seq: Sequence) -> ResumeReport:
        """What a resume that has landed found where (the scheduler classifies and counts it)."""
        p = seq.parking
        replay = p.replay_until - seq.num_computed if seq.is_replaying else 0
        swapped = p.mode is PreemptMode.SWAP and not replay
        from_pool = p.restored_pages - (0 if swapped else p.restored_from_host
                                        + p.restored_from_disk)
        from_host = p.restored_from_host > 0 or (
            swapped and from_pool < self.pool.pages_for(p.swapped_tokens))
        sources = tuple(name for name, used in (("pool", from_pool > 0), ("host", from_host),
                                                ("disk", p.restored_from_disk > 0),
                                                ("recompute", replay > 0)) if used)
        return ResumeReport(len(p.cached_pages), p.restored_pages, replay, sources)

    def _state_charge(self) -> int:
        """What a hybrid sequence's state slot costs the budget when swapped (0 for others)."""
        return self.host.charged_bytes(self.pool.state_bytes) if self.pool.state_bytes else 0

    def _save_state(self, seq: Sequence) -> None:
        """A swap: the state slot's bytes into a host buffer of their own (before the slot is
        given up). Synchronous: a state is small beside the pages."""
        if self.pool.states is None:
            return
        seq.parking.host_state = self.host.allocate((self.pool.state_bytes,), torch.uint8)
        self.pool.states.read_into(seq.slot_id, seq.parking.host_state)

    def _drop_state(self, seq: Sequence) -> None:
        """The slot is given up: zeros (a recompute replays from position 0, a swap writes its
        copy back), so nothing reads a stale state by mistake."""
        if self.pool.states is not None:
            self.pool.states.clear(seq.slot_id)

    def _restore_state(self, seq: Sequence) -> None:
        """A swap's state back into its slot, byte for byte, and its host buffer released."""
        if seq.parking.host_state is None:
            return
        self.pool.states.write(seq.slot_id, seq.parking.host_state)
        self._release_state(seq)

    def _release_state(self, seq: Sequence) -> None:
        if seq.parking.host_state is not None:
            self.host.release(seq.parking.host_state)
            seq.parking.host_state = None

    def _num_resident(self, seq: Sequence) -> int:
        """Leading cached pages someone else holds too: they stay in the pool, uncopied."""
        num = 0
        for page in seq.parking.cached_pages:
            if self.pool.ref_count(page) < 2:
                break
            num += 1
        return num

    def _tier_part(self, seq: Sequence, resident: int) -> TierPart:
        """With a host tier: the full pages after the resident ones, which the tier keeps (a
        page the pool's cache did not register, its content having come first from another
        page, gets an origin of its own), and the bytes a swap would need and could free."""
        if self.tier is None:
            return TierPart()
        cache, pages = self.pool.cache, seq.parking.cached_pages[resident:]
        hashes = seq.page_hashes[resident:resident + len(pages)]
        origins = [cache.origin_of(page) if cache.find(h) == page else cache.new_origin()
                   for page, h in zip(pages, hashes, strict=True)]
        return TierPart(pages, hashes, origins, self.tier.new_bytes_for(hashes, origins),
                        self.tier.reclaimable_bytes(sparing=hashes))

    def _start_park_copy(self, seq: Sequence, plan: ParkPlan) -> Ticket | None:
        """The copy into the host tier and a fresh host buffer, or None where the host refused
        a buffer."""
        if self.pool.checkpoints is not None:  # a park wins over a hybrid's checkpoints
            self.pool.checkpoints.reclaim(plan.swap_bytes)
        try:
            seq.parking.tier_pages = self._save_to_tier(plan.tiered, plan.swap_bytes)
            seq.parking.host_kv = self.host.allocate(self.pool.swap_shape(len(plan.copied)),
                                                     self.pool.dtype)
            self._save_state(seq)
        except HostAllocationError as exc:
            log.warning("seq %s: %s; parking by recompute", seq.request_id, exc)
            self._let_go_of_tier(seq)
            if seq.parking.host_kv is not None:
                self.host.release(seq.parking.host_kv)
                seq.parking.host_kv = None
            return None
        seq.parking.host_bytes, seq.parking.swapped_tokens = plan.swap_bytes, seq.num_computed
        return self.copy.start_park(list(plan.copied), seq.parking.host_kv)

    def _save_to_tier(self, tiered: TierPart, num_bytes: int) -> list[HostPage]:
        if self.tier is None:
            return []
        self.tier.reclaim(num_bytes, sparing=tiered.hashes)  # a park wins over cached pages
        return self.tier.save_held(tiered.pages, tiered.hashes, tiered.origins)

    def _let_go_of_tier(self, seq: Sequence) -> None:
        if seq.parking.tier_pages:
            self.tier.let_go(seq.parking.tier_pages)
        seq.parking.tier_pages = []

    # ---- resume ------------------------------------------------------------------------------
    def resume(self, seq: Sequence) -> Resumed | None:
        """Give a parked sequence its pages back: what it continues with, or None while its
        swap copy is still in flight (`reap` reports it once it lands); a recompute park gets
        the pages it replays step by step."""
        found = self._take_back_cached(seq)
        replay_until = seq.parking.replay_until
        if seq.parking.host_kv is not None and len(found) < seq.parking.resident_pages:
            replay_until = self._drop_host_copy(seq)  # a resident page was lost: replay
        if seq.parking.host_kv is None:  # parked by recompute: replay what neither tier holds
            found += self._load_any_from_tier(seq, len(found))
            num_computed = len(found) * self.pool.page_size
            return Resumed(found, num_computed, replay_until if replay_until > num_computed else 0)
        started = time.perf_counter()
        held = [*found, *self._load_own_from_tier(seq, len(found))]
        num_pages = self.pool.pages_for(seq.parking.swapped_tokens) - len(held)
        # what neither the pool nor the tier gave back (host_kv starts after both)
        skipped = len(held) - seq.parking.resident_pages - len(seq.parking.tier_pages)
        host_kv = seq.parking.host_kv[:, skipped:]
        seq.parking.held_pages = held
        ticket = self.copy.start_resume(self.pool.allocate(num_pages), host_kv)
        if not self.copy.poll(ticket):
            self.transfers.start(seq, ticket)
            return None
        return self._resume_landed(seq, ticket, started)

    def _load_own_from_tier(self, seq: Sequence, num_found: int) -> list[int]:
        """Fresh pool pages holding its own pages the tier keeps for it, after those the pool
        still had; registered in the pool's cache again with their origins."""
        kept = seq.parking.tier_pages[num_found - seq.parking.resident_pages:]
        if not kept:
            return []
        pages = self.pool.allocate(len(kept))
        self.tier.load(pages, kept)
        for page, host_page in zip(pages, kept, strict=True):
            self.pool.cache.register(page, host_page.hash, host_page.origin)
        seq.parking.restored_from_host = len(kept)
        return pages

    def _load_any_from_tier(self, seq: Sequence, num_found: int) -> list[int]:
        """A recompute: pages with the content of those its park released (any origin) that
        the tier holds after what the pool still had."""
        released = len(seq.parking.cached_pages)
        found = self.pool.load_from_tiers(seq.page_hashes[num_found:released])
        seq.parking.restored_pages += len(found.pages)
        seq.parking.restored_from_host = found.from_host
        seq.parking.restored_from_disk = found.from_disk
        return found.pages

    def _drop_host_copy(self, seq: Sequence) -> int:
        """The swap's copy cannot fill a hole the pool left: drop it; the tokens to replay."""
        log.info("seq %s: a page it shared was evicted while parked; replaying from there "
                 "instead of copying back", seq.request_id)
        self.host.release(seq.parking.host_kv)
        self._release_state(seq)
        self._let_go_of_tier(seq)
        seq.parking.host_kv, seq.parking.host_bytes = None, 0
        seq.parking.resident_pages = 0
        return seq.parking.swapped_tokens

    def _take_back_cached(self, seq: Sequence) -> list[int]:
        """The longest prefix of the pages its park released that is still cached, shared
        again. A swapped sequence takes back only its own pages (same bytes on any device); a
        recomputed one any page with the same content."""
        cache, released = self.pool.cache, seq.parking.cached_pages
        seq.parking.restored_pages = seq.parking.restored_from_host = 0
        seq.parking.restored_from_disk = 0
        if cache is None or not released:
            return []
        found = cache.lookup(seq.page_hashes[:len(released)])
        if seq.parking.host_kv is not None:
            found = list(itertools.takewhile(lambda pair: pair[0] == pair[1],
                                             zip(found, released)))
            found = [page for page, _ in found]
        self.pool.share(found)
        seq.parking.restored_pages = len(found)
        return found

    def _resume_landed(self, seq: Sequence, ticket: Ticket, started: float) -> Resumed:
        pages = [*seq.parking.held_pages, *ticket.pages]
        seq.parking.held_pages = []
        self._restore_state(seq)
        self.host.release(seq.parking.host_kv)
        self._let_go_of_tier(seq)
        seq.parking.host_kv, seq.parking.host_bytes = None, 0
        seq.parking.resident_pages = 0
        self.copy_times.resume.append(time.perf_counter() - started)
        return Resumed(pages, seq.num_computed, copied_back=True)

    # ---- copies in flight --------------------------------------------------------------------
    def reap(self) -> list[tuple[Sequence, Resumed]]:
        """Settle the copies that have landed; returns the resumes that landed."""
        resumed = []
        for seq, release, ticket in self.transfers.reap(self.copy.poll):
            if release.outcome is Outcome.RESUMED:
                resumed.append((seq, self._resume_landed(seq, ticket, ticket.started_at)))
                continue
            self.pool.free(list(release.free_pages))
            if release.release_host:  # cancelled mid-copy
                self.host.release(ticket.host_buf)
            else:
                self.copy_times.park.append(time.perf_counter() - ticket.started_at)
        return resumed

    def wait_all(self) -> list[tuple[Sequence, Resumed]]:
        """Block until every copy in flight has landed, then settle them (idle or shutdown)."""
        for ticket in self.transfers.tickets():
            self.copy.wait(ticket)
        return self.reap()

    def cancel(self, seq: Sequence) -> None:
        """Give back everything a finishing sequence holds (a copy in flight: once it lands);
        the scheduler then empties its page table."""
        if not self.transfers.cancel(seq):
            self.pool.free(seq.page_table)
            if seq.parking.host_kv is not None:
                self.host.release(seq.parking.host_kv)
        self._release_state(seq)
        self.pool.free(seq.parking.held_pages)  # cache hits a resume copy was joining
        self._let_go_of_tier(seq)  # its bytes are copied (ordered) or no longer wanted
        seq.parking.held_pages = []
        seq.parking.host_kv, seq.parking.host_bytes = None, 0
