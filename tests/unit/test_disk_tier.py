"""The disk tier wired to the pool: every page registered is written through; a prefix the pool
and host RAM miss comes back from disk byte for byte, at admission and at a recompute resume,
in this process or a new one on the same folder; a hybrid's state checkpoints go to disk and
come back with their pages; at shutdown what the disk lacks is written within a deadline, and
what time did not allow is counted as dropped; a planted link is never followed."""

import logging
import os

import torch
from test_host_tier import finished_run, flush_pool
from test_host_tier import make as make_with_host_tier
from test_prefix_cache import PS, kv_bytes, make_seq, run_to
from tmpfs import remount_read_only, tmpfs

from kvpark.pod.core import checkpointing
from kvpark.pod.core.reporting import slot_view
from kvpark.pod.core.sequence import PreemptMode
from kvpark.pod.memory.checkpoints import CheckpointStore
from kvpark.pod.memory.disk_store import STATE_SUFFIX, DiskPageStore
from kvpark.pod.memory.disk_tier import DiskTier
from kvpark.pod.memory.disk_writer import DiskWriter
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.identity import ModelIdentity
from kvpark.pod.serving.disk_cache import write_out

IDENTITY = ModelIdentity("m", 1, "abc", "float32", "gguf", True, 2, 1, 2, PS)
STATE_BYTES = 24


def disk_for(pool, root, states: bool = False) -> DiskTier:
    store = DiskPageStore(root, IDENTITY, pool.host_page_shape, pool.dtype, 1 << 30)
    state_store = DiskPageStore(root, IDENTITY, (STATE_BYTES,), torch.uint8, 1 << 30,
                                suffix=STATE_SUFFIX, stats=store.stats) if states else None
    return DiskTier(store, DiskWriter(store), state_store)


def make(root, **kw):
    scheduler, pool, tier = make_with_host_tier(**kw)
    pool.disk = disk_for(pool, root)
    return scheduler, pool, tier


def push_out_of_host_ram(scheduler, pool, other_prompt):
    """Another conversation's pages take the pool and then the host tier's room."""
    finished_run(scheduler, other_prompt, len(other_prompt))
    flush_pool(pool)


def test_a_page_that_went_pool_host_disk_comes_back_byte_for_byte(tmp_path):
    scheduler, pool, tier = make(tmp_path, budget_pages=3)
    prompt = list(range(1, 14))  # three full pages and a token
    before = finished_run(scheduler, prompt, 13)
    assert pool.disk.writer.flush(10) and pool.disk.store.stats.writes == 3  # written through
    flush_pool(pool)  # pool -> host RAM
    assert tier.num_pages == 3
    push_out_of_host_ram(scheduler, pool, list(range(50, 63)))  # host RAM -> gone
    assert tier.stats.drops == 3 and pool.num_cached_pages == 0
    again = make_seq(prompt)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 12 and again.cached_from == ("disk",)
    assert pool.disk.store.stats.hits == 3
    run_to(scheduler, again, 13)
    assert kv_bytes(pool, again, 13) == before


def test_without_the_disk_tier_that_prefix_is_computed_again(tmp_path):
    scheduler, pool, _ = make(tmp_path, budget_pages=3)
    pool.disk = None
    prompt = list(range(1, 14))
    finished_run(scheduler, prompt, 13)
    flush_pool(pool)
    push_out_of_host_ram(scheduler, pool, list(range(50, 63)))
    again = make_seq(prompt)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 0 and again.cached_from == ()


def test_the_pool_then_host_ram_then_the_disk_serve_one_prefix_in_order(tmp_path):
    scheduler, pool, tier = make(tmp_path, num_pages=12, budget_pages=1)
    prompt = list(range(1, 18))  # four full pages and a token
    before = finished_run(scheduler, prompt, 17)
    pool.disk.writer.flush(10)
    taken = pool.allocate(pool.num_free_pages - 1)  # the first page stays, the rest go
    pool.free(taken)
    again = make_seq(prompt)
    scheduler.add(again)
    scheduler.schedule()
    assert again.num_cached == 16
    assert again.cached_from == ("pool", "host", "disk") or again.cached_from == ("pool", "disk")
    run_to(scheduler, again, 17)
    assert kv_bytes(pool, again, 17) == before


def test_a_new_process_on_the_same_folder_finds_the_pages(tmp_path):
    first, pool, _ = make(tmp_path)
    prompt = list(range(1, 14))
    before = finished_run(first, prompt, 13)
    pool.disk.writer.flush(10)
    second, pool2, _ = make(tmp_path)  # a restart: empty pool, empty host RAM
    again = make_seq(prompt)
    second.add(again)
    second.schedule()
    assert again.num_cached == 12 and again.cached_from == ("disk",)
    run_to(second, again, 13)
    assert kv_bytes(pool2, again, 13) == before


def test_a_recompute_resume_reads_what_neither_ram_tier_holds_from_disk(tmp_path):
    scheduler, pool, tier = make(tmp_path, num_pages=8, budget_pages=0)
    pool.tier = None
    seq = make_seq(list(range(1, 11)))
    scheduler.add(seq)
    run_to(scheduler, seq, 14)
    before = kv_bytes(pool, seq, 14)
    pool.disk.writer.flush(10)
    assert scheduler.park(seq) is PreemptMode.RECOMPUTE
    flush_pool(pool)  # the three full pages it released are gone from the pool
    scheduler.resume(seq)
    assert seq.num_computed == 12 and seq.parking.replay_until == 14
    assert seq.parking.restored_from_disk == 3
    assert slot_view(seq).resumed_from == ("disk", "recompute")
    run_to(scheduler, seq, 14)
    assert kv_bytes(pool, seq, 14) == before


def test_the_shutdown_write_out_writes_what_the_disk_lacks_and_says_so(tmp_path, caplog):
    scheduler, pool, tier = make(tmp_path, budget_pages=8)
    disk, pool.disk = pool.disk, None  # the pages are made while the disk tier is away
    before = finished_run(scheduler, list(range(1, 14)), 13)
    flush_pool(pool)  # three pages in host RAM
    finished_run(scheduler, list(range(50, 59)), 9)  # two in the pool
    pool.disk = disk
    with caplog.at_level(logging.INFO, logger="kvpark.disk"):
        result = write_out(pool, 30)
    assert (result.pages, result.dropped) == (5, 0)
    assert result.bytes == 5 * disk.store.file_bytes
    [line] = [r.getMessage() for r in caplog.records if "at shutdown" in r.getMessage()]
    assert "5 files" in line and "0 dropped for lack of time" in line
    second, pool2, _ = make(tmp_path)
    again = make_seq(list(range(1, 14)))
    second.add(again)
    second.schedule()
    run_to(second, again, 13)
    assert again.num_cached == 12 and kv_bytes(pool2, again, 13) == before


def test_what_the_deadline_leaves_out_is_counted_as_dropped(tmp_path, caplog):
    scheduler, pool, _ = make(tmp_path)
    disk, pool.disk = pool.disk, None
    finished_run(scheduler, list(range(1, 14)), 13)
    pool.disk = disk
    with caplog.at_level(logging.INFO, logger="kvpark.disk"):
        result = write_out(pool, 0)
    assert (result.pages, result.dropped) == (0, 3)
    assert "3 dropped for lack of time" in caplog.text


def test_a_page_already_on_disk_is_not_written_again(tmp_path):
    scheduler, pool, _ = make(tmp_path)
    finished_run(scheduler, list(range(1, 14)), 13)
    finished_run(scheduler, list(range(1, 14)), 13)  # the same prompt: hits, nothing new
    pool.disk.writer.flush(10)
    assert pool.disk.store.stats.writes == 3 and pool.disk.stats.queued == 3


def test_a_full_write_queue_drops_pages_and_the_engine_goes_on(tmp_path):
    scheduler, pool, _ = make(tmp_path)
    pool.disk.writer.max_pending_bytes = 1  # one page at a time: the rest are turned away
    finished_run(scheduler, list(range(1, 30)), 29)
    pool.disk.writer.flush(10)
    assert pool.disk.stats.dropped > 0
    assert pool.disk.stats.queued + pool.disk.stats.dropped == 7
    # a dropped page is not "known": the shutdown write-out writes it
    result = write_out(pool, 30)
    assert pool.disk.store.stats.writes == 7 and result.dropped == 0


def test_a_link_planted_under_a_pages_name_is_refused_and_its_target_untouched(tmp_path):
    scheduler, pool, _ = make(tmp_path / "cache")
    outside = tmp_path / "secret"
    outside.write_bytes(b"do not touch" * 100)
    prompt = list(range(1, 6))  # one full page
    seq = make_seq(prompt)
    pool.disk.store.folder.mkdir(parents=True, exist_ok=True)
    page_hash = pool.cache.grow_hashes([], prompt, len(prompt), 1)[0]
    link = pool.disk.store.path(page_hash)
    os.symlink(outside, link)
    scheduler.add(seq)
    scheduler.schedule()
    assert seq.num_cached == 0 and pool.disk.store.stats.rejected == 1
    assert not os.path.lexists(link) and outside.read_bytes() == b"do not touch" * 100
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert all(p.is_relative_to(pool.disk.store.folder) for p in files)


# ---- a hybrid's state checkpoints --------------------------------------------------------------
class FakeStates:
    """The state pool's part that checkpointing writes: one slot of flat bytes."""

    def __init__(self) -> None:
        self.slots: dict[int, torch.Tensor] = {}
        self.snapshots = 0

    def write(self, slot: int, state: torch.Tensor) -> None:
        self.slots[slot] = state.clone()

    def snapshot(self, slot: int) -> None:
        self.snapshots += 1


def hybrid_pool(tmp_path):
    _, pool, _ = make_with_host_tier()
    pool.states = FakeStates()
    pool.checkpoints = CheckpointStore(HostStore(-1), STATE_BYTES)
    pool.disk = disk_for(pool, tmp_path, states=True)
    return pool


def test_a_hybrids_checkpoint_comes_back_from_disk_with_its_pages(tmp_path):
    first = hybrid_pool(tmp_path)
    hashes = first.cache.grow_hashes([], list(range(1, 13)), 12, 3)
    state = torch.arange(STATE_BYTES, dtype=torch.uint8)
    first.checkpoints.put(hashes[1], state)
    assert first.disk.offer_state(hashes[1], state) and first.disk.writer.flush(10)
    second = hybrid_pool(tmp_path)  # a restart: no checkpoint in memory
    pages = second.allocate(3)
    kept = checkpointing.cut_to_checkpoint(second, second.checkpoints, 0, hashes, pages)
    assert kept == pages[:2]  # up to the page the checkpoint ends at
    assert torch.equal(second.states.slots[0], state)
    assert second.checkpoints.has(hashes[1]) and second.disk.stats.state_hits == 1


def test_a_damaged_checkpoint_file_falls_back_to_an_earlier_one(tmp_path):
    first = hybrid_pool(tmp_path)
    hashes = first.cache.grow_hashes([], list(range(1, 13)), 12, 3)
    early, late = torch.zeros(STATE_BYTES, dtype=torch.uint8), torch.ones(STATE_BYTES,
                                                                          dtype=torch.uint8)
    first.disk.offer_state(hashes[0], early)
    first.disk.offer_state(hashes[2], late)
    first.disk.writer.flush(10)
    path = first.disk.states.path(hashes[2])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    second = hybrid_pool(tmp_path)
    pages = second.allocate(3)
    kept = checkpointing.cut_to_checkpoint(second, second.checkpoints, 0, hashes, pages)
    assert kept == pages[:1] and torch.equal(second.states.slots[0], early)
    assert second.disk.store.stats.rejected == 1 and not path.exists()


def test_the_shutdown_write_out_keeps_checkpoints_too(tmp_path):
    pool = hybrid_pool(tmp_path)
    hashes = pool.cache.grow_hashes([], list(range(1, 9)), 8, 2)
    pool.checkpoints.put(hashes[1], torch.full((STATE_BYTES,), 7, dtype=torch.uint8))
    result = write_out(pool, 30)
    assert result.pages == 1 and pool.disk.states.contains(hashes[1])


def test_write_out_without_a_disk_tier_does_nothing():
    _, pool, _ = make_with_host_tier()
    assert write_out(pool, 30) is None


def test_a_slow_disk_cuts_a_lookup_short_and_the_rest_is_computed(tmp_path, monkeypatch):
    scheduler, pool, _ = make(tmp_path)
    prompt = list(range(1, 18))  # four full pages
    finished_run(scheduler, prompt, 17)
    pool.disk.writer.flush(10)
    second, pool2, _ = make(tmp_path)
    clock = iter(range(0, 100, 1))  # every read takes one second
    monkeypatch.setattr("kvpark.pod.memory.disk_tier.time.monotonic", lambda: next(clock))
    again = make_seq(prompt)
    second.add(again)
    second.schedule()
    monkeypatch.undo()
    assert again.num_cached == 2 * PS  # two reads fit the one-second budget, then it stops
    assert pool2.disk.stats.slow_reads == 1


def test_a_read_only_volume_stops_the_writes_with_one_line(tmp_path, caplog):
    with tmpfs(tmp_path / "volume", "4m") as mount:
        scheduler, pool, _ = make(mount)  # made while writable, then remounted read-only
        remount_read_only(mount)
        with caplog.at_level(logging.WARNING, logger="kvpark.disk"):
            finished_run(scheduler, list(range(1, 30)), 29)
            assert pool.disk.writer.flush(10)
    assert not pool.disk.store.writable
    assert caplog.text.count("cannot be written") == 1


def test_a_write_that_raises_does_not_stop_the_writer(tmp_path, caplog):
    scheduler, pool, _ = make(tmp_path)
    writes = pool.disk.store.write
    calls = []

    def fails_once(page_hash, kv):
        calls.append(page_hash)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return writes(page_hash, kv)

    pool.disk.store.write = fails_once
    with caplog.at_level(logging.ERROR, logger="kvpark.disk"):
        finished_run(scheduler, list(range(1, 14)), 13)
        assert pool.disk.writer.flush(10)
    assert pool.disk.writer.num_failed == 1 and pool.disk.store.stats.writes == 2
    assert caplog.text.count("writing a page failed") == 1
