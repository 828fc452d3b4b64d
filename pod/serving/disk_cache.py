"""The disk tier's wiring (`--cache-disk`): its store, keyed by what decides a page's bytes, and
the shutdown write-out of what the pool and host RAM hold that the disk lacks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch

from kvpark.kernels import cpu_features

from ..args import ServerArgs
from ..memory.disk_store import STATE_SUFFIX, DiskPageStore
from ..memory.disk_tier import WRITE_OUT_BATCH, DiskTier, WriteOut
from ..memory.disk_writer import DiskWriter
from ..memory.identity import ModelIdentity
from ..memory.kv_pool import KVPool

log = logging.getLogger("kvpark.disk")

GIB = 1 << 30
# pages waiting for the writer take host RAM outside the --preempt-ram budget: hold them to this
WRITE_QUEUE_BYTES = 256 << 20

Source = tuple[list[bytes], Callable[[], torch.Tensor]]


def machine_kind(device: torch.device) -> str:
    """What else decides a page's bits besides the model and kernels: the GPU model, or the
    CPU model and its flags (AVX2, AVX-512 and AMX paths round differently)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_features.fingerprint()


def make_disk_tier(args: ServerArgs, pool: KVPool, identity: ModelIdentity,
                   kernels: str) -> DiskTier | None:
    """--cache-disk DIR: the prefix cache's third tier. ValueError (exit 2) where it cannot be:
    no prefix cache, or a folder that cannot be made."""
    if args.cache_disk is None:
        return None
    if pool.cache is None:
        raise ValueError("--cache-disk needs the prefix cache (drop --no-prefix-cache)")
    numerics = f"{kernels}|{machine_kind(pool.device)}"
    try:
        store = DiskPageStore(args.cache_disk, identity, pool.host_page_shape, pool.dtype,
                              int(args.cache_disk_size * GIB), numerics)
    except OSError as exc:
        raise ValueError(f"--cache-disk {args.cache_disk}: {exc.strerror or exc}") from None
    states = None if pool.checkpoints is None else DiskPageStore(
        args.cache_disk, identity, (pool.checkpoints.slot_bytes,), torch.uint8,
        store.max_bytes, numerics, suffix=STATE_SUFFIX, stats=store.stats)
    log.info("disk cache: on in %s, at most %.1f GiB, pages of %.0f KiB written through off "
             "the step (up to %d MiB queued); %.0f s at shutdown for what it lacks", store.folder,
             args.cache_disk_size, store.file_bytes / 1024, WRITE_QUEUE_BYTES >> 20,
             args.cache_disk_write_out)
    if states is not None:
        log.info("disk cache: with the state checkpoints (%.1f MiB each) that make a hybrid's "
                 "pages usable", states.file_bytes / (1 << 20))
    return DiskTier(store, DiskWriter(store, WRITE_QUEUE_BYTES), states)


def write_out(pool: KVPool, seconds: float) -> WriteOut | None:
    """At shutdown, the engine stopped: the pages the pool and host RAM hold that the disk
    lacks, written within `seconds`."""
    if pool.disk is None:
        return None
    states = pool.checkpoints.saved() if pool.checkpoints is not None else []
    return pool.disk.write_out(lacking(pool), states, time.monotonic() + seconds)


def lacking(pool: KVPool) -> Iterator[Source]:
    """Batches of pages the disk tier lacks: the pool's registered pages (those of running,
    parked and finished sequences), then the host tier's."""
    disk = pool.disk
    in_pool = [(page, h) for page, h in pool.registered_pages() if disk.lacks(h)]
    for start in range(0, len(in_pool), WRITE_OUT_BATCH):
        batch = in_pool[start:start + WRITE_OUT_BATCH]
        yield [h for _, h in batch], lambda batch=batch: pool.read_pages([p for p, _ in batch])
    on_host = [page for page in (pool.tier.pages() if pool.tier is not None else ())
               if disk.lacks(page.hash)]
    for start in range(0, len(on_host), WRITE_OUT_BATCH):
        batch = on_host[start:start + WRITE_OUT_BATCH]
        yield [p.hash for p in batch], lambda batch=batch: torch.stack([p.kv for p in batch], 1)
