"""Page accounting, byte-exact swap copies and the host RAM budget."""

import pytest
import torch

from kvpark.kernels.kv_copy import copy_in, copy_out
from kvpark.pod.memory.host_store import HostAllocationError, HostStore
from kvpark.pod.memory.kv_pool import KVPool


def make_pool(num_pages=8):
    return KVPool(num_layers=3, num_pages=num_pages, page_size=4, num_kv_heads=3, head_dim=5)


def test_pages_are_handed_out_and_returned():
    pool = make_pool()
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free_pages == 0
    assert not pool.can_allocate(1)
    pool.free(a)
    assert pool.num_free_pages == 3 and pool.usage_ratio == 5 / 8
    assert pool.allocate(3) == sorted(a)  # low ids first keeps sequences consecutive


def test_gather_then_scatter_to_other_pages_is_byte_exact():
    pool = make_pool()
    pages = pool.allocate(3)
    for cache in pool.caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache[pages].clone() for cache in pool.caches]
    store = HostStore(budget_bytes=-1)
    host = store.allocate(pool.swap_shape(len(pages)), pool.dtype)
    copy_out(pool, pages, host)
    assert store.held_bytes == pool.swap_bytes(3) == 3 * pool.page_bytes
    pool.free(pages)
    for cache in pool.caches:
        cache.zero_()
    pool.allocate(2)  # the sequence comes back to different pages
    new_pages = pool.allocate(3)
    assert new_pages != pages
    copy_in(pool, new_pages, host)
    for cache, old in zip(pool.caches, before):
        assert cache[new_pages].numpy().tobytes() == old.numpy().tobytes()
    store.release(host)
    assert store.held_bytes == 0


def test_budget_is_checked_before_allocating():
    store = HostStore(budget_bytes=1000)
    assert store.can_hold(1000) and not store.can_hold(1001)
    buf = store.allocate((250,), torch.float32)
    assert store.held_bytes == 1000 and not store.can_hold(1)
    with pytest.raises(AssertionError):
        store.allocate((1,), torch.float32)
    store.release(buf)
    assert store.can_hold(1000)


def test_injected_allocation_failure_is_reported():
    store = HostStore(budget_bytes=-1, fail_allocations=True)
    with pytest.raises(HostAllocationError):
        store.allocate((10,), torch.float32)
    assert store.held_bytes == 0


def test_real_allocation_failure_is_reported():
    store = HostStore(budget_bytes=-1)
    with pytest.raises(HostAllocationError):
        store.allocate((1 << 50,), torch.float32)  # 4 PiB: the allocator refuses
    assert store.held_bytes == 0


@pytest.mark.parametrize("budget", [-1, 0, 1, 1000])
def test_the_store_and_the_decision_keep_one_budget_rule(budget):
    """The decision to swap and the store that holds the bytes agree for every size, the empty
    budget included (0: nothing is ever held, not even a victim with no pages)."""
    from kvpark.pod.core import preemption as policy
    from kvpark.pod.core.sequence import PreemptMode

    store = HostStore(budget)
    for held in (0, 1, 999):
        store.held_bytes = held if budget in (-1, 1000) else 0
        for size in (0, 1, 500, 1000, 1 << 40):
            swaps = policy.choose_mode(size, budget, store.held_bytes) is PreemptMode.SWAP
            assert store.can_hold(size) == swaps, (budget, store.held_bytes, size)
    assert not HostStore(0).can_hold(0)


def test_a_pinned_buffer_is_charged_its_power_of_two_block():
    """PyTorch's caching host allocator rounds pinned blocks up to a power of two: the budget
    counts what the machine gives (pageable memory: what was asked)."""
    from kvpark.pod.memory.host_store import charged_bytes

    assert charged_bytes(368_640, pinned=False) == 368_640  # a SmolLM2 bf16 page
    assert charged_bytes(368_640, pinned=True) == 524_288
    assert charged_bytes(2 << 20, pinned=True) == 2 << 20  # already a power of two
    assert charged_bytes(0, pinned=True) == 0
    assert HostStore(-1, pin_memory=False).charged_bytes(1000) == 1000
