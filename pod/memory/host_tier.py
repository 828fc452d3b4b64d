"""The host tier: prefix-cache pages in host RAM, under the same `--preempt-ram` budget as parks.

A full page the pool's cache evicts is copied here (when there is room) instead of being lost,
keyed by the same chained hash; a later admission or resume that misses the pool finds it here
and copies it back instead of computing it again. Parked sequences keep their full pages here
too (`holders`), so a page in host RAM is one `HostPage` however many wait on it, and its bytes
are counted once: as *parked* while some parked sequence holds it, else as *cached*.

One budget, one accounting: every page is a buffer from the `HostStore`, so parked + cached
bytes never pass the budget. Cached pages are the first thing given up: a park that needs room
drops them, least recently used first, before it would fall through to recompute
(`reclaim`), and `--cache-ram` caps the cached part on its own. A held page is never dropped.

A page costs the budget its bytes and its bookkeeping (`PAGE_BOOKKEEPING_BYTES`: the tensor
object and allocation header of its buffer, its entries here and its hash), so the tier's RSS
stays inside the budget even where pages are small.

Each page keeps the *origin* of its bytes (`prefix_cache.py`): a swap trusts a host page only if
it holds exactly its own bytes, a recompute any page with the same hash.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvpark.kernels.kv_copy import CopyEngine

from .budget import UNLIMITED_BYTES
from .host_store import HostAllocationError, HostStore
from .kv_events import MEDIUM_HOST, KvEventLog
from .prefix_cache import Evicted, longest_run

# RSS a host page costs beyond its bytes, rounded up: measured with torch's CPU allocator and
# CPython 3.11 (`tests/unit/test_host_tier_rss.py` holds the tier to it)
PAGE_BOOKKEEPING_BYTES = 1024


@dataclass(eq=False, slots=True)
class HostPage:
    """One page's K/V in host RAM, under its chained hash."""

    hash: bytes
    origin: int
    kv: torch.Tensor  # [layers, 2, page_size, Hkv, D], charged to the host store
    holders: int = 0  # parked sequences counting on it: never dropped while > 0


@dataclass
class TierStats:
    """Counters and copy times the metrics read (the durations are drained by the metrics)."""

    lookups: int = 0  # pages looked up after the pool missed them (admission, resume)
    hits: int = 0  # of which found here and copied back
    saves: int = 0  # pages the pool evicted, copied here
    skipped: int = 0  # pages the pool evicted that found no room here
    drops: int = 0  # cached host pages given up for room (LRU)
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)


class HostTier:
    def __init__(self, store: HostStore, copy: CopyEngine, page_shape: tuple[int, ...],
                 dtype: torch.dtype, cap_bytes: int = UNLIMITED_BYTES) -> None:
        self.store = store
        self.copy = copy
        self.page_shape = page_shape  # [layers, 2, page_size, Hkv, D]
        self.dtype = dtype
        self.cap_bytes = cap_bytes  # --cache-ram: cached bytes at most (-1: what parks leave)
        # what one page costs the budget (a pinned block is rounded up: host_store.py)
        self.page_bytes = store.charged_bytes(
            torch.Size(page_shape).numel() * torch.empty((), dtype=dtype).element_size()
        ) + PAGE_BOOKKEEPING_BYTES
        self.stats = TierStats()
        self._pages: dict[bytes, HostPage] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # pages nobody holds, oldest first
        self.events: KvEventLog | None = None  # --kv-events-config: what is stored and removed

    # ---- what is here ------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def cached_bytes(self) -> int:
        """Bytes of pages nobody holds: what a park may reclaim."""
        return len(self._lru) * self.page_bytes

    @property
    def parked_bytes(self) -> int:
        """Bytes of pages parked sequences hold (counted as parked, never as cached)."""
        return (len(self._pages) - len(self._lru)) * self.page_bytes

    def pages(self) -> list[HostPage]:
        """Every page here, held or cached (the disk tier's write-out reads them)."""
        return list(self._pages.values())

    def lookup(self, hashes: Seq[bytes]) -> list[HostPage]:
        """The pages holding the longest run of `hashes` found here."""
        self.stats.lookups += len(hashes)
        return longest_run(hashes, self._pages)

    # ---- holding -----------------------------------------------------------------------------
    def hold(self, pages: Iterable[HostPage]) -> None:
        """Keep these pages until `let_go` (a parked sequence, or a copy-back under way)."""
        for page in pages:
            page.holders += 1
            self._lru.pop(page.hash, None)

    def let_go(self, pages: Iterable[HostPage]) -> None:
        """Holders done: a page nobody holds is cached again, most recently used."""
        for page in pages:
            assert page.holders > 0, "let go of a host page nobody held"
            page.holders -= 1
            if page.holders == 0 and self._pages.get(page.hash) is page:
                self._lru[page.hash] = None
            elif page.holders == 0:  # replaced while held: nobody can find it any more
                self._free(page.kv)
        self._trim_to_cap()

    # ---- room --------------------------------------------------------------------------------
    def reclaimable_bytes(self, sparing: Collection[bytes] = ()) -> int:
        """Cached bytes `reclaim` may drop: all but the pages under `sparing` hashes."""
        spared = sum(1 for h in sparing if h in self._lru)
        return (len(self._lru) - spared) * self.page_bytes

    def reclaim(self, num_bytes: int, sparing: Collection[bytes] = ()) -> bool:
        """Drop cached pages, oldest first (not those under `sparing` hashes), until the store
        can hold `num_bytes` more: a park wins over the cache. False when even that would not
        do."""
        if self.store.can_hold(num_bytes):
            return True
        sparing = set(sparing)
        for h in [h for h in self._lru if h not in sparing]:
            self._drop(h)
            if self.store.can_hold(num_bytes):
                break
        return self.store.can_hold(num_bytes)

    def _room_for_one_more(self, sparing: Collection[bytes]) -> bool:
        """Room for one more cached page within `--cache-ram` and the budget, made by dropping
        older cached pages (never those under `sparing` hashes)."""
        if self.cap_bytes != UNLIMITED_BYTES:
            excess = len(self._lru) + 1 - self.cap_bytes // self.page_bytes
            older = (h for h in self._lru if h not in sparing)
            for h in list(itertools.islice(older, max(0, excess))):
                self._drop(h)
            if len(self._lru) + 1 > self.cap_bytes // self.page_bytes:
                return False
        return self.reclaim(self.page_bytes, sparing)

    def _trim_to_cap(self) -> None:
        while self._lru and self.cap_bytes != UNLIMITED_BYTES \
                and self.cached_bytes > self.cap_bytes:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self._drop(next(iter(self._lru)))

    def _drop(self, h: bytes) -> None:
        del self._lru[h]
        self._free(self._pages.pop(h).kv)
        self.stats.drops += 1
        if self.events is not None:
            self.events.removed(MEDIUM_HOST, [h])

    # ---- copies ------------------------------------------------------------------------------
    def keep(self, evicted: list[Evicted]) -> None:
        """The pool is about to reuse these pages (least recently used first): copy each in one
        batch unless its content is here already or there is no room. Where room runs out the
        most recently used win: a sequence's prefix, which its tail depends on. (A park's own
        buffer never holds a full page while a tier exists, so nothing is kept twice.)"""
        started, to_copy, batch = time.perf_counter(), [], set()
        for entry in reversed(evicted):
            if entry.hash in self._pages:
                continue
            # room is made by dropping older pages, never this batch's (not yet copied)
            kv = self._allocate() if self._room_for_one_more(batch) else None
            if kv is None:
                self.stats.skipped += 1
                continue
            self._pages[entry.hash] = page = HostPage(entry.hash, entry.origin, kv)
            self._lru[entry.hash] = None
            to_copy.append((entry.page, page))
            batch.add(entry.hash)
        for _, page in reversed(to_copy):  # the LRU in the pool's order: newest last
            self._lru.move_to_end(page.hash)
        if self.events is not None:
            self.events.stored(MEDIUM_HOST, [page.hash for _, page in reversed(to_copy)])
        if to_copy:
            self.copy.save([p for p, _ in to_copy], [page.kv for _, page in to_copy])
            self.stats.saves += len(to_copy)
            self.stats.save_seconds.append(time.perf_counter() - started)

    def save_held(self, pool_pages: list[int], hashes: list[bytes], origins: list[int]
                  ) -> list[HostPage]:
        """A park's full pages, held here for it: pages already here with the same bytes are
        not copied again; the caller has made room (`reclaim`) for the rest. Raises
        HostAllocationError, holding nothing, when the store refuses a buffer."""
        found = [self._pages.get(h) for h in hashes]
        fresh = [i for i, (page, origin) in enumerate(zip(found, origins, strict=True))
                 if page is None or page.origin != origin]
        buffers: list[torch.Tensor] = []
        try:
            buffers = [self._new_page() for _ in fresh]
        except HostAllocationError:
            for kv in buffers:
                self._free(kv)
            raise
        for i, kv in zip(fresh, buffers, strict=True):
            found[i] = self._replace(hashes[i], origins[i], kv)
        held = [page for page in found if page is not None]
        self.hold(held)
        if fresh:
            started = time.perf_counter()
            self.copy.save([pool_pages[i] for i in fresh], buffers)
            self.stats.save_seconds.append(time.perf_counter() - started)
        return held

    def new_bytes_for(self, hashes: list[bytes], origins: list[int]) -> int:
        """Bytes `save_held` would allocate for these pages (those not here with their bytes)."""
        missing = sum(1 for h, origin in zip(hashes, origins, strict=True)
                      if (page := self._pages.get(h)) is None or page.origin != origin)
        return missing * self.page_bytes

    def load(self, pool_pages: list[int], pages: list[HostPage]) -> None:
        """Copy host pages back into pool pages; they stay here, most recently used."""
        if not pages:
            return
        started = time.perf_counter()
        self.copy.load(pool_pages, [page.kv for page in pages])
        for page in pages:
            if page.hash in self._lru:
                self._lru.move_to_end(page.hash)
        self.stats.hits += len(pages)
        self.stats.load_seconds.append(time.perf_counter() - started)

    def _replace(self, h: bytes, origin: int, kv: torch.Tensor) -> HostPage:
        """`kv` becomes the page for `h`; an older page with other bytes under the same hash
        stops being findable (freed now, or by its last holder: see `let_go`)."""
        old = self._pages.get(h)
        if old is not None and old.holders == 0:
            del self._lru[h]
            self._free(old.kv)
        page = HostPage(h, origin, kv)
        self._pages[h] = page
        if self.events is not None and old is None:  # a page replaced is still held here
            self.events.stored(MEDIUM_HOST, [h])
        return page

    def _allocate(self) -> torch.Tensor | None:
        try:
            return self._new_page()
        except HostAllocationError:
            return None

    def _new_page(self) -> torch.Tensor:
        """A page's buffer, charged with its bookkeeping; HostAllocationError when refused."""
        return self.store.allocate(self.page_shape, self.dtype, PAGE_BOOKKEEPING_BYTES)

    def _free(self, kv: torch.Tensor) -> None:
        self.store.release(kv, PAGE_BOOKKEEPING_BYTES)
