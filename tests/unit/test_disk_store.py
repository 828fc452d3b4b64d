"""The disk tier's files (issue 42, first step): a page comes back byte for byte, from this store
or another one on the same folder (another server); a damaged, truncated, foreign-model or
other-page file is refused and deleted; a half-written temporary file is never read and is
removed at start; the folder is held to its size least recently used first; a full disk (a
real 64 KiB tmpfs) stops the writing with one log line and nothing else fails; the writer
thread publishes what it was given."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time

import pytest
import torch
from tmpfs import tmpfs

from kvpark.pod.memory.disk_store import SUFFIX, DiskPageStore
from kvpark.pod.memory.disk_writer import DiskWriter
from kvpark.pod.memory.identity import ModelIdentity
from kvpark.pod.memory.slot_files import TEMP_SUFFIX

IDENTITY = ModelIdentity("m", 1, "abc", "float32", "gguf", True, 2, 1, 4, 16)
SHAPE = (2, 2, 16, 1, 4)  # [layers, K/V, page_size, Hkv, D]


def page(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def store_at(root, identity=IDENTITY, max_bytes=1 << 30) -> DiskPageStore:
    return DiskPageStore(root, identity, SHAPE, torch.float32, max_bytes)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_page_comes_back_byte_for_byte_here_and_in_another_store(tmp_path):
    first, second = store_at(tmp_path), store_at(tmp_path)  # two servers, one folder
    kv = page(1)
    kv.view(-1)[0] = float("nan")  # bits, not values: a NaN payload too
    assert first.write(b"h" * 32, kv) and not first.write(b"h" * 32, kv)  # once
    for store in (first, second):
        back = store.read(b"h" * 32)
        assert back is not None and same_bits(back, kv)
    assert second.read(b"x" * 32) is None and second.stats.misses == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "grow", "other page"])
def test_a_damaged_file_is_refused_and_removed(tmp_path, damage, caplog):
    store = store_at(tmp_path)
    store.write(b"h" * 32, page(2))
    path = store.path(b"h" * 32)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "grow":
        data += b"\0"
    else:  # a good file under another page's name
        store.write(b"g" * 32, page(3))
        data = bytearray(store.path(b"g" * 32).read_bytes())
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvpark.disk"):
        assert store.read(b"h" * 32) is None
    assert not path.exists() and store.stats.rejected == 1
    assert "refused and removed" in caplog.text


def test_another_models_file_is_never_used(tmp_path):
    mine, theirs = store_at(tmp_path), store_at(
        tmp_path, dataclasses.replace(IDENTITY, weights_sha256="other"))
    assert mine.folder != theirs.folder  # each model its own folder
    theirs.write(b"h" * 32, page(4))
    os.replace(theirs.path(b"h" * 32), mine.path(b"h" * 32))  # copied in by hand
    assert mine.read(b"h" * 32) is None and mine.stats.rejected == 1


def test_a_half_written_file_is_never_read_and_a_dead_writers_is_removed(tmp_path):
    store = store_at(tmp_path)
    dead = 4_000_000  # above any pid_max: no such process
    stale = store.folder / f".kvpark-{socket.gethostname()}-{dead}-x{TEMP_SUFFIX}"
    stale.write_bytes(b"half a page")
    assert store.read(b"h" * 32) is None  # a temporary name is never a page's
    store_at(tmp_path)  # a restart
    assert not stale.exists()


def test_the_folder_is_held_to_its_size_least_recently_used_first(tmp_path):
    store = store_at(tmp_path)
    hashes = [bytes([i]) * 32 for i in range(4)]
    now = time.time()
    for age, h in zip((40, 30, 20, 10), hashes):  # oldest first
        store.write(h, page(h[0]))
        os.utime(store.path(h), (now - age, now - age))
    store.read(hashes[0])  # used again: the newest now
    store.max_bytes = 2 * store.file_bytes
    assert store.trim() == 2 and store.stats.evicted == 2
    assert [store.contains(h) for h in hashes] == [True, False, False, True]


def test_a_full_disk_stops_the_writing_with_one_line(tmp_path, caplog):
    with tmpfs(tmp_path / "small", "64k") as mount:
        store = store_at(mount)
        with caplog.at_level(logging.WARNING, logger="kvpark.disk"):
            written = [store.write(bytes([i]) * 32, page(i)) for i in range(40)]
        assert written[0] and not all(written) and not store.writable
        assert caplog.text.count("is full") == 1
        assert not list(store.folder.glob(f"*{TEMP_SUFFIX}"))  # no partial file left
        good = [i for i, ok in enumerate(written) if ok]
        assert all(same_bits(store.read(bytes([i]) * 32), page(i)) for i in good)  # reads go on


def test_the_writer_thread_publishes_and_flushes(tmp_path):
    store = store_at(tmp_path)
    writer = DiskWriter(store)
    pages = {bytes([i]) * 32: page(10 + i) for i in range(5)}
    for h, kv in pages.items():
        assert writer.put(h, kv)
    assert writer.flush(timeout=30)
    assert sorted(p.name for p in store.folder.glob(f"*{SUFFIX}")) == sorted(
        f"{h.hex()}{SUFFIX}" for h in pages)
    assert all(same_bits(store.read(h), kv) for h, kv in pages.items())
