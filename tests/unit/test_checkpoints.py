"""State checkpoints under the host budget: kept least recently used last, dropped for room, a
park's reclaim takes them, and a cached prefix is usable up to the latest one."""

from __future__ import annotations

import torch

from kvpark.pod.core.checkpointing import usable_pages
from kvpark.pod.memory.checkpoints import CheckpointStore
from kvpark.pod.memory.host_store import HostStore

SLOT = 1000  # bytes of one state slot


def state(value: int) -> torch.Tensor:
    return torch.full((SLOT,), value, dtype=torch.uint8)


def test_the_budget_holds_them_and_the_oldest_goes_first():
    host = HostStore(budget_bytes=2 * SLOT + 10)
    store = CheckpointStore(host, SLOT)
    assert store.put(b"a", state(1)) and store.put(b"b", state(2))
    store.get(b"a")  # a is now the most recently used
    assert store.put(b"c", state(3))
    assert (store.has(b"a"), store.has(b"b"), store.has(b"c")) == (True, False, True)
    assert host.held_bytes == store.bytes == 2 * SLOT and store.stats.evictions == 1
    assert torch.equal(store.get(b"c"), state(3))


def test_nothing_is_kept_where_the_budget_cannot_hold_one():
    store = CheckpointStore(HostStore(budget_bytes=SLOT - 1), SLOT)
    assert not store.put(b"a", state(1)) and len(store) == 0


def test_a_park_reclaims_their_bytes():
    host = HostStore(budget_bytes=3 * SLOT)
    store = CheckpointStore(host, SLOT)
    for key in (b"a", b"b", b"c"):
        store.put(key, state(0))
    store.reclaim(2 * SLOT)
    assert len(store) == 1 and store.has(b"c") and host.can_hold(2 * SLOT)


def test_a_prefix_is_usable_up_to_its_latest_checkpoint():
    store = CheckpointStore(HostStore(budget_bytes=10 * SLOT), SLOT)
    hashes = [b"p0", b"p1", b"p2", b"p3"]
    assert usable_pages(store, hashes, 4) == 0
    store.put(b"p1", state(0))
    assert usable_pages(store, hashes, 4) == 2
    assert usable_pages(store, hashes, 1) == 0  # the checkpoint lies past the cached pages
    store.put(b"p3", state(0))
    assert usable_pages(store, hashes, 4) == 4 and usable_pages(store, hashes, 3) == 2


def test_a_restored_checkpoint_is_also_the_slot_s_snapshot():
    """Else a sequence that restored a checkpoint and ended before its next page boundary
    would offer the slot's former occupant's snapshot as its own checkpoint."""
    from kvpark.pod.core.checkpointing import cut_to_checkpoint
    from kvpark.pod.memory.kv_pool import KVPool
    from kvpark.pod.memory.state_pool import StatePool
    from kvpark.pod.model.config import DeltaNetConfig

    shape = DeltaNetConfig(num_k_heads=1, num_v_heads=2, k_head_dim=4, v_head_dim=4)
    pool = KVPool(1, 8, 4, 1, 4)
    pool.states = StatePool(2, 1, shape, snapshots=True)
    store = CheckpointStore(HostStore(budget_bytes=-1), pool.states.slot_bytes)
    saved = torch.arange(pool.states.slot_bytes, dtype=torch.int64).to(torch.uint8)
    store.put(b"p0", saved)
    pool.states.recurrent[0][1].fill_(7.0)  # a former occupant's state and snapshot
    pool.states.snapshot(1)
    kept = cut_to_checkpoint(pool, store, 1, [b"p0", b"p1"], pool.allocate(2))
    assert len(kept) == 1 and pool.num_free_pages == 7
    out = torch.empty(pool.states.slot_bytes, dtype=torch.uint8)
    pool.states.read_into(1, out)
    assert torch.equal(out, saved)
    pool.states.read_snapshot_into(1, out)
    assert torch.equal(out, saved)


def test_the_pool_holds_the_newest_and_moves_the_oldest_to_host_ram():
    host = HostStore(budget_bytes=SLOT)
    store = CheckpointStore(host, SLOT, pool_slots=2)
    for value, key in enumerate((b"a", b"b", b"c", b"d")):
        assert store.put(key, state(value))
    # the pool keeps c and d; a went to host RAM for c, then made room there for b
    assert store.num_in_pool == 2 and len(store) == 3
    assert (store.has(b"a"), store.has(b"b")) == (False, True)
    assert store.stats.moved_to_host == 2 and store.stats.evictions == 1
    assert host.held_bytes == store.bytes == SLOT
    assert [int(store.get(k)[0]) for k in (b"b", b"c", b"d")] == [1, 2, 3]


def test_without_a_budget_the_pools_checkpoints_still_serve():
    store = CheckpointStore(HostStore(budget_bytes=0), SLOT, pool_slots=1)
    assert store.put(b"a", state(1)) and store.put(b"b", state(2))
    assert (store.has(b"a"), store.has(b"b")) == (False, True) and store.bytes == 0
    assert store.stats.evictions == 1
    store.reclaim(10 * SLOT)  # a park takes host bytes only
    assert store.has(b"b") and torch.equal(store.get(b"b"), state(2))
    store.drop(b"b")
    assert len(store) == 0 and store.put(b"c", state(3)) and store.num_in_pool == 1
