"""The paged KV pool shared by every slot: one cache tensor per layer, a free list of pages.

A sequence's page table is a plain `list[int]`; the pool hands pages out and takes them back.
Pages carry reference counts: with a prefix cache (`prefix_cache.py`) a full page may sit in
several page tables, and a page whose last holder let go stays *cached* (evictable, LRU) rather
than free. Cached pages count as allocatable: `allocate` takes free pages first, then evicts the
least recently used cached ones, so the pool is full only when free + cached pages run out.
Swapping (`swap.py`, with `kernels/kv_copy.py`) moves whole pages between the pool and a host
buffer, so a parked sequence comes back bit for bit.

With a host tier (`host_tier.py`) an evicted cached page is copied to host RAM before its new
owner writes it, and a prefix the pool misses is looked up there next and copied back. With a
disk tier (`disk_tier.py`) every page registered is also written through to disk, and a prefix
that host RAM misses too is read back from there.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, NamedTuple

import torch

from .paging import pages_for
from .prefix_cache import Evicted, PrefixCache

if TYPE_CHECKING:
    from .checkpoints import CheckpointStore
    from .disk_tier import DiskTier
    from .host_tier import HostTier
    from .state_pool import StatePool


class TierLoad(NamedTuple):
    """Pages a lookup past the pool found, fresh in the pool: the first `from_host` copied
    from host RAM, the rest read from disk."""

    pages: list[int]
    from_host: int
    from_disk: int


class CachedPrefix(NamedTuple):
    """A new prompt's cached pages (one reference each), by where they were found in order:
    the pool's own first, then host RAM's, then the disk's."""

    pages: list[int]
    from_pool: int
    from_host: int
    from_disk: int

    def sources(self, num_kept: int) -> tuple[str, ...]:
        """Where the first `num_kept` pages came from (a hybrid may keep fewer)."""
        ends = (("pool", self.from_pool), ("host", self.from_pool + self.from_host),
                ("disk", len(self.pages)))
        start, found = 0, []
        for name, end in ends:
            if min(end, num_kept) > start:
                found.append(name)
            start = end
        return tuple(found)


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", cache: PrefixCache | None = None) -> None:
        assert num_pages > 0 and page_size > 0, "the pool needs at least one page"
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_shape = (2, page_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        # [pages, 2, page_size, Hkv, D] per layer: FlashInfer's NHD paged layout
        self.caches = [
            torch.zeros(num_pages, *self.page_shape, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # a min-heap hands out low page ids first, so a lone sequence's pages tend to be
        # consecutive and attention can read them through a view
        self._free = list(range(num_pages))
        self._refs = [0] * num_pages  # holders of each page: page tables and copies in flight
        self.cache = cache
        self.tier: HostTier | None = None  # set once the copy engine exists (server wiring)
        self.disk: DiskTier | None = None  # --cache-disk (server wiring)
        # a hybrid model's state slots, the pool's second kind of memory, and with a prefix
        # cache the checkpoints that make its cached pages usable (server wiring)
        self.states: StatePool | None = None
        self.checkpoints: CheckpointStore | None = None

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can have: free ones and evictable cached ones."""
        return len(self._free) + self.num_cached_pages

    @property
    def num_cached_pages(self) -> int:
        return self.cache.num_cached_pages if self.cache is not None else 0

    @property
    def num_used_pages(self) -> int:
        """Pages someone holds (cached pages are not used: any allocation may take them)."""
        return self.num_pages - self.num_free_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def usage_ratio(self) -> float:
        return self.num_used_pages / self.num_pages

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds across all layers (what a swap copies per page)."""
        per_layer = torch.Size(self.page_shape).numel() * self.caches[0].element_size()
        return per_layer * len(self.caches)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int]:
        """Fresh pages, one reference each: free pages first, then evicted cached ones."""
        assert self.can_allocate(num_pages), (
            f"asked for {num_pages} pages with {self.num_free_pages} free"
        )
        pages, evicted = [], []
        for _ in range(num_pages):
            if self._free:
                pages.append(heapq.heappop(self._free))
            else:
                evicted.append(self.cache.evict())
                pages.append(evicted[-1].page)
        self._keep_on_host(evicted)
        for page in pages:
            assert self._refs[page] == 0, f"page {page} handed out while held"
            self._refs[page] = 1
        return pages

    def _keep_on_host(self, evicted: list[Evicted]) -> None:
        # before the new owners write them: the copy is ordered ahead of the next step
        if evicted and self.tier is not None:
            self.tier.keep(evicted)

    def share(self, pages: list[int]) -> None:
        """One more reference to each page (a cache hit); cached pages leave the LRU."""
        for page in pages:
            if self._refs[page] == 0:
                self.cache.touch(page)
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds is kept cached when it is
        registered, else freed. Released last page first, so a sequence's tail is evicted
        before the prefix it depends on."""
        for page in reversed(pages):
            assert self._refs[page] > 0, f"page {page} released more often than held"
            self._refs[page] -= 1
            if self._refs[page] == 0 and not (self.cache is not None and self.cache.keep(page)):
                heapq.heappush(self._free, page)

    def take_cached_prefix(self, hashes: list[bytes], num_queried: int) -> CachedPrefix:
        """Pages (one reference each) holding the longest run of a new prompt's page `hashes`
        cached in the pool, then in the host tier, then on disk; `num_queried` prompt tokens
        count as looked up."""
        if self.cache is None:
            return CachedPrefix([], 0, 0, 0)
        pages = self.cache.lookup(hashes)
        self.share(pages)
        self.cache.stats.queries += num_queried
        self.cache.stats.hits += len(pages) * self.page_size
        found = self.load_from_tiers(hashes[len(pages):])
        return CachedPrefix(pages + found.pages, len(pages), found.from_host, found.from_disk)

    def load_from_tiers(self, hashes: list[bytes]) -> TierLoad:
        """Fresh pages (one reference each) holding the longest run of `hashes` the host tier
        has, continued by what the disk tier has, as many as the pool can give; registered as
        cached content (host pages with their origins, disk pages with new ones)."""
        pages = self._load_from_host(hashes)
        more = self._load_from_disk(hashes[len(pages):]) if len(pages) < len(hashes) else []
        return TierLoad(pages + more, len(pages), len(more))

    def _load_from_host(self, hashes: list[bytes]) -> list[int]:
        if self.tier is None or not hashes:
            return []
        run = self.tier.lookup(hashes)[:self.num_free_pages]
        self.tier.hold(run)  # the allocation below may make the tier drop pages for room
        pages = self.allocate(len(run))
        self.tier.load(pages, run)
        for page, host_page in zip(pages, run):
            self.cache.register(page, host_page.hash, host_page.origin)
        self.tier.let_go(run)
        return pages

    def _load_from_disk(self, hashes: list[bytes]) -> list[int]:
        if self.disk is None or not hashes:
            return []
        run = self.disk.read_run(hashes, self.num_free_pages)
        if not run:
            return []
        pages = self.allocate(len(run))
        self.write_pages(pages, torch.stack(run, dim=1))
        for page, h in zip(pages, hashes):
            self.cache.register(page, h, self.cache.new_origin())
        return pages

    def register_complete(self, page_table: list[int], hashes: list[bytes], first: int) -> None:
        """Pages full of K/V of every layer become findable in the prefix cache: those of
        `page_table` from index `first` on, under `hashes` (one per full page)."""
        if self.cache is None:
            return
        for page, h in zip(page_table[first:len(hashes)], hashes[first:]):
            self.cache.register(page, h)
        if self.disk is not None:
            self._write_through(page_table[first:len(hashes)], hashes[first:])

    def _write_through(self, pages: list[int], hashes: list[bytes]) -> None:
        """Pages the disk tier lacks, copied out for its writer (values: the pool may reuse
        the pages before they are written)."""
        lacking = [i for i, h in enumerate(hashes) if self.disk.lacks(h)]
        if lacking:
            self.disk.offer([hashes[i] for i in lacking],
                            self.read_pages([pages[i] for i in lacking]))

    # ---- slot files (POST /slots/{id}?action=save|restore|erase) ------------------------------
    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of these pages on the CPU: [layers, pages, 2, page_size, Hkv, D]."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        return torch.stack([cache.index_select(0, index) for cache in self.caches]).cpu()

    def write_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """`kv` ([layers, len(pages), 2, page_size, Hkv, D], any device) into these pages."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        rows = kv.to(device=self.device, dtype=self.dtype)
        for cache, layer_rows in zip(self.caches, rows):
            cache.index_copy_(0, index, layer_rows)

    def registered_pages(self) -> list[tuple[int, bytes]]:
        """(page, hash) of every page the prefix cache can find (the disk's write-out)."""
        return self.cache.registered() if self.cache is not None else []

    def insert_cached(self, hashes: list[bytes], kv: torch.Tensor) -> bool:
        """Make `kv` ([layers, len(hashes), 2, page_size, Hkv, D]) cached pages under `hashes`,
        as if a sequence had just filled them and let go; content already cached is kept as it
        is. False, with nothing changed, when the pool cannot give the missing pages."""
        assert self.cache is not None and kv.shape[1] == len(hashes)
        found = [self.cache.find(h) for h in hashes]
        self.share([p for p in found if p is not None])  # out of the LRU: not evicted below
        missing = [i for i, page in enumerate(found) if page is None]
        if not self.can_allocate(len(missing)):
            self.free([p for p in found if p is not None])
            return False
        fresh = self.allocate(len(missing))
        if missing:
            self.write_pages(fresh, kv[:, missing])
        for page, i in zip(fresh, missing):
            self.cache.register(page, hashes[i])
            found[i] = page
        if self.disk is not None:
            self._write_through(fresh, [hashes[i] for i in missing])
        self.free([p for p in found if p is not None])  # tail first into the LRU, as a finish
        return True

    def drop_cached(self, pages: list[int]) -> int:
        """Forget those of these pages that sit cached with no holder (free them); pages a
        sequence holds stay. Returns how many were dropped."""
        dropped = [p for p in pages if self.cache is not None and self.cache.is_cached(p)]
        for page in dropped:
            self.cache.forget(page)
            heapq.heappush(self._free, page)
        return len(dropped)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    @property
    def host_page_shape(self) -> tuple[int, ...]:
        """One page of every layer as the host tier keeps it: [layers, 2, page_size, Hkv, D]."""
        return (len(self.caches), *self.page_shape)

    def swap_shape(self, num_pages: int) -> tuple[int, ...]:
        return (len(self.caches), num_pages, *self.page_shape)

    def swap_bytes(self, num_pages: int) -> int:
        return num_pages * self.page_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state slot (a hybrid model's; 0 for others)."""
        return self.states.slot_bytes if self.states is not None else 0
