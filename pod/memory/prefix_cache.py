"""The prefix cache: full KV pages by the hash of their tokens, chained with their predecessor's.

A page is registered here once it is full; while someone holds it, it may be shared (read-only:
only full pages are shared, and a sequence writes only past them). When its last holder lets go
it stays in the pool as *cached*, in LRU order, until an allocation that found no free page
evicts it. The pool (`kv_pool.py`) owns the reference counts and the free list; this owns the
hash table and the LRU. Hashes are SHA-256 over (predecessor, tokens), seeded with the model
identity, so a collision would have to be a SHA-256 one.

Each registered page also carries an *origin*: a number naming the computation that wrote its
bytes. Copies keep it (the host tier's, a swap's), so "the same bytes" can be asked exactly
where the same hash is not enough (on CUDA two computations of one page may differ in bits).

Where prompt rows and generated rows run through different weights (a GGUF's decode rows read
its quantised blocks on the CPU) their K/V bytes differ for the same tokens, so the hash also
says how many of the page's tokens were prompt rows (`split_kinds`): a page decoded in one
request is not reused as prompt by the next, and the cache never changes an output.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TypeVar

from .kv_events import MEDIUM_POOL, KvEventLog

T = TypeVar("T")


@dataclass
class CacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which found cached
    evictions: int = 0  # cached pages taken back for new content


@dataclass(frozen=True)
class Evicted:
    """A cached page given up for new content: what the host tier needs to keep a copy."""

    page: int
    hash: bytes
    origin: int


def seed_hash(identity: str) -> bytes:
    return hashlib.sha256(identity.encode()).digest()


def chain_hash(prev: bytes, tokens: Seq[int], num_prompt_rows: int | None) -> bytes:
    """The hash of one full page: its predecessor's hash, its tokens, and (when row kinds
    matter) how many of them were prompt rows."""
    h = hashlib.sha256(prev)
    h.update(array("q", tokens).tobytes())
    if num_prompt_rows is not None:
        h.update(num_prompt_rows.to_bytes(4, "little"))
    return h.digest()


def longest_run(hashes: Seq[bytes], table: Mapping[bytes, T]) -> list[T]:
    """The entries of `table` for the longest prefix of `hashes` it holds (a chain of page
    hashes: a missing page ends what can be reused)."""
    run = []
    for h in hashes:
        entry = table.get(h)
        if entry is None:
            break
        run.append(entry)
    return run


class PrefixCache:
    def __init__(self, identity: str, page_size: int, split_kinds: bool = False) -> None:
        self.seed = seed_hash(identity)
        self.page_size = page_size
        self.split_kinds = split_kinds
        self.stats = CacheStats()
        self._pages: dict[bytes, int] = {}  # hash -> page holding that content
        self._hash_of: dict[int, bytes] = {}  # page -> its hash (registered pages only)
        self._origin_of: dict[int, int] = {}  # page -> the computation that wrote its bytes
        self._origins = itertools.count(1)
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest 1st
        self.events: KvEventLog | None = None  # --kv-events-config: what is stored and removed

    @property
    def num_cached_pages(self) -> int:
        return len(self._lru)

    def is_registered(self, page: int) -> bool:
        return page in self._hash_of

    def registered(self) -> list[tuple[int, bytes]]:
        """(page, hash) of every registered page."""
        return list(self._hash_of.items())

    # ---- hashes ------------------------------------------------------------------------------
    def grow_hashes(self, hashes: list[bytes], tokens: Seq[int], num_prompt: int,
                    num_full_pages: int) -> list[bytes]:
        """The hashes of the first `num_full_pages` pages of `tokens` (`num_prompt` of them
        prompt rows), continuing `hashes` (those of its first pages): a new list where pages
        were added, `hashes` itself where none were. A restored slot file's come from here."""
        if len(hashes) >= num_full_pages:
            return hashes
        grown, ps = list(hashes), self.page_size
        while len(grown) < num_full_pages:
            i = len(grown)
            prev = grown[-1] if grown else self.seed
            kinds = min(ps, max(0, num_prompt - i * ps)) if self.split_kinds else None
            grown.append(chain_hash(prev, tokens[i * ps:(i + 1) * ps], kinds))
            if self.events is not None:
                self.events.describe(grown[-1], grown[-2] if i else None,
                                     tokens[i * ps:(i + 1) * ps])
        return grown

    # ---- lookups and registration ------------------------------------------------------------
    def lookup(self, hashes: Seq[bytes]) -> list[int]:
        """Pages holding the longest registered prefix of `hashes`."""
        return longest_run(hashes, self._pages)

    def find(self, h: bytes) -> int | None:
        """The page holding this content, if any."""
        return self._pages.get(h)

    def register(self, page: int, h: bytes, origin: int | None = None) -> None:
        """A page just filled (or copied in, keeping the `origin` of its bytes); the first page
        seen with some content keeps that content's entry (a duplicate stays private and goes
        back to the free list when released)."""
        if h not in self._pages and page not in self._hash_of:
            self._pages[h] = page
            self._hash_of[page] = h
            self._origin_of[page] = origin if origin is not None else next(self._origins)
            if self.events is not None:
                self.events.stored(MEDIUM_POOL, [h])

    def new_origin(self) -> int:
        """A name for bytes computed apart from the registered page with the same hash."""
        return next(self._origins)

    def origin_of(self, page: int) -> int | None:
        return self._origin_of.get(page)

    # ---- the LRU of unreferenced pages (called by the pool) ----------------------------------
    def keep(self, page: int) -> bool:
        """The page's last holder let go: keep it as cached if registered."""
        if page not in self._hash_of:
            return False
        self._lru[page] = None
        return True

    def touch(self, page: int) -> None:
        """A cached page is referenced again: out of the LRU."""
        self._lru.pop(page, None)

    def forget(self, page: int) -> None:
        """An unreferenced cached page dropped on purpose (a slot erased); the caller frees it."""
        del self._lru[page]
        h = self._hash_of.pop(page)
        del self._pages[h]
        del self._origin_of[page]
        if self.events is not None:
            self.events.removed(MEDIUM_POOL, [h])

    def is_cached(self, page: int) -> bool:
        """Registered and held by nobody (in the LRU)."""
        return page in self._lru

    def evict(self) -> Evicted:
        """The least recently used cached page, forgotten; the caller reuses it."""
        page, _ = self._lru.popitem(last=False)
        h = self._hash_of.pop(page)
        del self._pages[h]
        self.stats.evictions += 1
        if self.events is not None:
            self.events.removed(MEDIUM_POOL, [h])
        return Evicted(page, h, self._origin_of.pop(page))
