"""The disk tier's files (issue 42, first step): one full page per file, named by its chained
hash (`prefix_cache.py`) under a folder of the model's identity, so several servers can share a
folder (a ReadWriteMany volume) and a restarted one finds what its predecessor kept.

A file: MAGIC (8 bytes) | version u32 | identity digest (32) | page hash (32) | dtype (16,
NUL-padded) | shape (6 x u32) | payload length u64 | BLAKE2b-256 of the payload (32) | payload.
A file is used only if every field matches what this server would have written and the payload
checks out; anything else (another model's, another layout's, truncated, damaged) is refused,
counted and deleted. A writer publishes a whole file or nothing: it writes a temporary file
named by its host and pid and renames it over the name (`os.replace` is atomic), and no lock is
held across I/O; temporary files of writers that died are removed at start (`slot_files.py`'s
rules). Two writers of one page race harmlessly: the same hash is the same content.

The folder is held to `max_bytes` least recently used first: a read touches a file's mtime, so
every server sharing the folder shares one LRU. A full disk (ENOSPC, EDQUOT) is logged once and
the store stops writing; reads go on.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .identity import ModelIdentity
from .slot_files import TEMP_SUFFIX, remove_stale_temp_files, temp_prefix

log = logging.getLogger("kvpark.disk")

MAGIC = b"KVPPAGE\0"
VERSION = 1
SUFFIX = ".kvpage"
STATE_SUFFIX = ".kvstate"  # a hybrid model's state checkpoint, under its page's hash
SUFFIXES = (SUFFIX, STATE_SUFFIX)  # the folder's one size budget counts both kinds
_HEADER = struct.Struct("<8sI32s32s16s6IQ32s")
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
# errors that stay: the store stops writing with one line rather than one per page
STOPS_WRITING = (*FULL_DISK, errno.EROFS, errno.EACCES, errno.EPERM)


@dataclass
class DiskStats:
    """Counters the metrics read (the store's own thread writes them)."""

    writes: int = 0  # pages published
    write_bytes: int = 0
    hits: int = 0  # pages read back and checked
    misses: int = 0
    rejected: int = 0  # files refused (foreign, truncated, damaged) and deleted
    evicted: int = 0  # files deleted for room
    bytes: int = 0  # the folder's page files, as of the latest trim plus writes since


def identity_digest(identity: ModelIdentity, numerics: str = "") -> bytes:
    """The model identity and `numerics` (the kernels and the machine kind that computed the
    K/V: another CPU's kernels may round differently, and a page must change no output)."""
    return hashlib.sha256(f"{identity.text}|{numerics}".encode()).digest()


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


class DiskPageStore:
    """Pages of one model in one folder (shared with other servers of the same model)."""

    def __init__(self, root: str | Path, identity: ModelIdentity, page_shape: tuple[int, ...],
                 dtype: torch.dtype, max_bytes: int, numerics: str = "", suffix: str = SUFFIX,
                 stats: DiskStats | None = None) -> None:
        """`suffix`: the kind of file (pages, or a hybrid's state checkpoints: a second store
        on the same folder, sharing its `stats` and its size)."""
        self.identity = identity_digest(identity, numerics)
        # a folder per identity: another model's pages are never even looked at
        self.folder = Path(root) / self.identity.hex()[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self.payload_bytes = torch.Size(page_shape).numel() * dtype.itemsize
        self.file_bytes = _HEADER.size + self.payload_bytes
        self.max_bytes = max_bytes
        self.suffix = suffix
        self.writable = True
        self.stats = stats if stats is not None else DiskStats()
        self._dtype_name = str(dtype).removeprefix("torch.").encode()
        removed = remove_stale_temp_files(str(self.folder))
        if removed:
            log.info("disk tier: removed %d temporary files of writers that died", len(removed))

    # ---- names -------------------------------------------------------------------------------
    def path(self, page_hash: bytes) -> Path:
        return self.folder / f"{page_hash.hex()}{self.suffix}"

    def contains(self, page_hash: bytes) -> bool:
        return self.path(page_hash).is_file()

    # ---- writing -----------------------------------------------------------------------------
    def header(self, page_hash: bytes, payload: bytes) -> bytes:
        shape = (*self.page_shape, *[0] * (6 - len(self.page_shape)))
        return _HEADER.pack(MAGIC, VERSION, self.identity, page_hash, self._dtype_name, *shape,
                            len(payload), checksum(payload))

    def write(self, page_hash: bytes, kv: torch.Tensor) -> bool:
        """Publish one page (a CPU tensor of `page_shape`); False when it was not written (there
        already, the store stopped writing, or the disk is full)."""
        target = self.path(page_hash)
        if not self.writable or target.exists():
            return False
        assert tuple(kv.shape) == self.page_shape and kv.dtype == self.dtype
        payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), suffix=TEMP_SUFFIX, dir=self.folder)
            with os.fdopen(fd, "wb") as file:
                file.write(self.header(page_hash, payload))
                file.write(payload)
            os.replace(tmp, target)
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            self._write_failed(exc)
            return False
        self.stats.writes += 1
        self.stats.write_bytes += self.file_bytes
        self.stats.bytes += self.file_bytes
        return True

    def _write_failed(self, exc: OSError) -> None:
        if exc.errno in STOPS_WRITING:
            self.writable = False
            log.warning("disk tier: %s %s (%s); it stops writing, reads go on", self.folder,
                        "is full" if exc.errno in FULL_DISK else "cannot be written",
                        exc.strerror)
        else:
            log.warning("disk tier: writing a page failed: %s", exc)

    # ---- reading -----------------------------------------------------------------------------
    def read(self, page_hash: bytes) -> torch.Tensor | None:
        """The page if a good file holds it; a bad one is deleted (and counted)."""
        path = self.path(page_hash)
        try:
            with open(path, "rb") as file:
                data = file.read(self.file_bytes + 1)
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as exc:
            log.warning("disk tier: reading %s failed: %s", path.name, exc)
            self.stats.misses += 1
            return None
        problem = self.problem(page_hash, data)
        if problem is not None:
            self._reject(path, problem)
            return None
        self._touch(path)
        self.stats.hits += 1
        payload = bytearray(data[_HEADER.size:])
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(
            self.page_shape)

    def problem(self, page_hash: bytes, data: bytes) -> str | None:
        """Why these bytes are not this page as this server writes it (None: they are)."""
        if len(data) != self.file_bytes:
            return f"{len(data)} bytes, not {self.file_bytes} (truncated or another layout)"
        (magic, version, identity, stored_hash, dtype, *rest) = _HEADER.unpack_from(data)
        shape, length, digest = tuple(rest[:6]), rest[6], rest[7]
        if magic != MAGIC or version != VERSION:
            return "not a kvpark page file of this version"
        if identity != self.identity:
            return "written for another model or pool layout"
        if stored_hash != page_hash:
            return "holds another page"
        if dtype.rstrip(b"\0") != self._dtype_name or shape[:len(self.page_shape)] != \
                self.page_shape or length != self.payload_bytes:
            return "another dtype or page shape"
        if checksum(memoryview(data)[_HEADER.size:]) != digest:
            return "damaged (checksum)"
        return None

    def _reject(self, path: Path, why: str) -> None:
        log.warning("disk tier: %s refused and removed: %s", path.name, why)
        self.stats.rejected += 1
        path.unlink(missing_ok=True)

    @staticmethod
    def _touch(path: Path) -> None:
        try:  # the shared LRU's clock; a file evicted meanwhile by another server is fine
            os.utime(path)
        except OSError:
            pass

    # ---- room --------------------------------------------------------------------------------
    def files(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every page and state file, least recently used first."""
        found = []
        for path in (p for suffix in SUFFIXES for p in self.folder.glob(f"*{suffix}")):
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append((stat.st_mtime, stat.st_size, path))
        return sorted(found)

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.files())

    def trim(self) -> int:
        """Delete the least recently used files until the folder holds at most `max_bytes`;
        how many were deleted."""
        files = self.files()
        used = sum(size for _, size, _ in files)
        deleted = 0
        for _, size, path in files:
            if used <= self.max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:  # another server took it first
                pass
            used -= size
            deleted += 1
        self.stats.evicted += deleted
        self.stats.bytes = used
        return deleted

