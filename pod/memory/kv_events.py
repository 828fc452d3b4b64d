"""KV events: what the prefix cache and its host tier come to hold and give up, as vLLM
reports it to a router (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), so llm-d's precise
prefix scorer can send a returning conversation to the replica holding its pages.

The memory layer records each change here as it happens, on the engine thread (an append);
the engine hands what a step recorded to the publisher as values (`drain`), which encodes and
sends it on its own thread (`serving/kv_event_publisher.py`).

What is reported, and where: a page registered in the pool's prefix cache is stored on `GPU`
(vLLM's name for its main pool, on whichever device the pool is) and removed when evicted or
dropped; a page copied to the host tier is stored on `CPU`, and removed when the tier drops it.
A parked sequence's full pages sit in the host tier (held for it, findable by any request with
that prefix), so they are reported as `CPU` pages while parked; its private partial page is
findable by nobody and not reported. A fresh process starts with `AllBlocksCleared`.

Block hashes are kvpark's own chained SHA-256 page hashes (`prefix_cache.py`), sent as vLLM
sends its own: the last 8 bytes as an unsigned integer. Each stored run carries its token ids
and its parent's hash, so a router that keys blocks by its own hash of the tokens (llm-d maps
an engine's keys to its request keys this way) can place them; the block size is the page size.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

MEDIUM_POOL = "GPU"  # vLLM's name for its main pool
MEDIUM_HOST = "CPU"
# pages whose tokens are remembered, least recently described dropped: about 13 MB at most
# (a page's hash and parent, and its tokens as int32 bytes)
MAX_DESCRIBED = 1 << 16


def external_hash(h: bytes) -> int:
    """A page hash as vLLM publishes its own: the last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(h[-8:], "big")


@dataclass(frozen=True)
class BlocksStored:
    """A run of pages, each the parent of the next, now held on `medium`."""

    hashes: tuple[int, ...]
    parent: int | None  # the first page's predecessor (None: the first page of a prompt)
    token_ids: tuple[int, ...]  # every page's tokens, in order ((): not known any more)
    block_size: int
    medium: str


@dataclass(frozen=True)
class BlocksRemoved:
    hashes: tuple[int, ...]
    medium: str


@dataclass(frozen=True)
class AllCleared:
    pass


KvEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass
class _Run:
    """A stored run still growing within a step."""

    hashes: list[int]
    parent: int | None
    tokens: list[int] | None  # None once a page's tokens were not known
    medium: str


class KvEventLog:
    """The engine thread's record of one step's changes (only that thread writes it)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._events: list[_Run | KvEvent] = [AllCleared()]
        # page hash -> (its predecessor's hash, its tokens): filled as hashes are computed
        self._described: OrderedDict[bytes, tuple[bytes | None, bytes]] = OrderedDict()

    def describe(self, h: bytes, parent: bytes | None, tokens: Seq[int]) -> None:
        """What page `h` holds, for the stores that report it later."""
        self._described[h] = (parent, array("i", tokens).tobytes())
        self._described.move_to_end(h)
        if len(self._described) > MAX_DESCRIBED:
            self._described.popitem(last=False)

    def stored(self, medium: str, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            parent, packed = self._described.get(h, (None, None))
            tokens = None if packed is None else tuple(array("i", packed))
            self._store_one(medium, external_hash(h),
                            None if parent is None else external_hash(parent), tokens)

    def _store_one(self, medium: str, h: int, parent: int | None,
                   tokens: tuple[int, ...] | None) -> None:
        last = self._events[-1] if self._events else None
        if (isinstance(last, _Run) and last.medium == medium and parent is not None
                and last.hashes[-1] == parent):
            last.hashes.append(h)  # the next page of the same chain: one event
            last.tokens = None if last.tokens is None or tokens is None \
                else [*last.tokens, *tokens]
            return
        self._events.append(_Run([h], parent, None if tokens is None else list(tokens),
                                 medium))

    def removed(self, medium: str, hashes: Iterable[bytes]) -> None:
        ids = tuple(external_hash(h) for h in hashes)
        if not ids:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, BlocksRemoved) and last.medium == medium:
            self._events[-1] = BlocksRemoved(last.hashes + ids, medium)
        else:
            self._events.append(BlocksRemoved(ids, medium))

    def drain(self) -> list[KvEvent]:
        """The events recorded since the last drain, as values, oldest first."""
        events, self._events = self._events, []
        return [self._frozen(e) if isinstance(e, _Run) else e for e in events]

    def _frozen(self, run: _Run) -> BlocksStored:
        return BlocksStored(tuple(run.hashes), run.parent,
                            () if run.tokens is None else tuple(run.tokens), self.page_size,
                            run.medium)
