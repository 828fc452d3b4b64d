"""The host tier on the GPU pool: pages evicted from the pool go to pinned host pages (on the copy
stream, the compute stream waiting for them there) and come back bit for bit, at admission and
at a swap's resume; greedy output equals a run without the tier. Sync and async copy engines.
(Written without a GPU in the session that added it: run by the next session that draws one.)"""

import pytest
from gpu_stack import (
    PAGE_SIZE,
    LogitsRecorder,
    Stack,
    kv_rows,
    make_seq,
    random_tokens,
    same_bytes,
)

from kvpark.pod.core.sequence import PreemptMode

pytestmark = pytest.mark.gpu

PROMPT = 75
PARK_AT = 85  # five full pages and five tokens of a sixth (16-token pages)
MAX_TOKENS = 24


def flush(pool) -> None:
    """Someone takes every page: every cached page is evicted (to the host tier) and written."""
    taken = pool.allocate(pool.num_free_pages)
    for cache in pool.caches:
        cache[taken] = 7.0
    pool.free(taken)


@pytest.mark.parametrize("copy", ["sync", "async"])
def test_a_swap_comes_back_from_the_host_tier_bit_for_bit(smollm2, flashinfer, copy):
    prompt = random_tokens(PROMPT, seed=11)
    stack = Stack(smollm2, num_pages=32, copy=copy, host_tier=True)
    pool, scheduler = stack.pool, stack.scheduler
    recorder = LogitsRecorder()
    seq = make_seq("parked", prompt, max_tokens=MAX_TOKENS, constraint=recorder)
    stack.run(seq, until=lambda: seq.num_computed >= PARK_AT)
    before = kv_rows(pool, seq.page_table, PARK_AT).clone()
    assert scheduler.park(seq) is PreemptMode.SWAP
    assert len(seq.parking.tier_pages) == PARK_AT // PAGE_SIZE and seq.parking.host_kv.shape[1] == 1
    flush(pool)
    scheduler.resume(seq)
    scheduler.wait_for_copies()
    assert seq.parking.restored_from_host == PARK_AT // PAGE_SIZE
    assert same_bytes(kv_rows(pool, seq.page_table, PARK_AT), before)
    stack.run()
    reference = LogitsRecorder()
    never = make_seq("never parked", prompt, max_tokens=MAX_TOKENS, constraint=reference)
    Stack(smollm2, num_pages=32, copy=copy).run(never)
    assert seq.generated_ids == never.generated_ids
    assert all(same_bytes(a, b) for a, b in zip(recorder.logits, reference.logits))


@pytest.mark.parametrize("copy", ["sync", "async"])
def test_an_evicted_prompt_comes_back_from_host_ram_at_admission(smollm2, flashinfer, copy):
    prompt = random_tokens(PROMPT, seed=12)
    stack = Stack(smollm2, num_pages=32, copy=copy, host_tier=True)
    first = make_seq("first", prompt, max_tokens=1)
    stack.run(first)
    flush(stack.pool)
    assert stack.pool.num_cached_pages == 0 and stack.pool.tier.num_pages >= PROMPT // PAGE_SIZE
    recorder, reference = LogitsRecorder(), LogitsRecorder()
    again = make_seq("again", prompt, max_tokens=MAX_TOKENS, constraint=recorder)
    stack.run(again)
    assert again.num_cached == (PROMPT - 1) // PAGE_SIZE * PAGE_SIZE
    never = make_seq("no tier", prompt, max_tokens=MAX_TOKENS, constraint=reference)
    Stack(smollm2, num_pages=32, copy=copy).run(never)
    assert again.generated_ids == never.generated_ids
    assert all(same_bytes(a, b) for a, b in zip(recorder.logits, reference.logits))
