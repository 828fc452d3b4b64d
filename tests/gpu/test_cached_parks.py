"""Cache-aware parks on the GPU pool: a swapped sequence's full pages stay cached in the pool,
and its resume takes back those still there and copies in from host RAM only the pages evicted
while it was parked (and its partial last page). The bytes are its own either way, so the K/V
after the resume are bit for bit those before the park, on any device, and greedy output is the
same as a run that never parked: asserted bit for bit, through FlashInfer and CUDA graphs, with
the synchronous and the asynchronous (copy stream) engine."""

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
from page_sets import free_page_ids

from kvpark.kernels.kv_copy import CopyKind
from kvpark.pod.core.sequence import Phase, PreemptMode

pytestmark = pytest.mark.gpu

PROMPT = 75
PARK_AT = 85  # tokens computed when parked: five full pages and five tokens of a sixth
FULL_PAGES = PARK_AT // PAGE_SIZE
EVICTED = 2  # the last two full pages: a sequence's pages are released (and evicted) tail first
MAX_TOKENS = 24


@pytest.mark.parametrize("copy", ["sync", "async"])
def test_a_swap_resume_copies_back_only_the_pages_evicted_while_parked(smollm2, flashinfer,
                                                                       copy):
    prompt = random_tokens(PROMPT, seed=11)
    stack = Stack(smollm2, num_pages=32, copy=copy)
    pool, scheduler = stack.pool, stack.scheduler
    recorder = LogitsRecorder()
    seq = make_seq("parked", prompt, max_tokens=MAX_TOKENS, constraint=recorder)
    stack.run(seq, until=lambda: seq.num_computed >= PARK_AT)
    assert seq.num_computed == PARK_AT
    table = list(seq.page_table)
    before = kv_rows(pool, table, PARK_AT).clone()

    assert scheduler.park(seq) is PreemptMode.SWAP  # waits for its copy to land
    assert pool.num_cached_pages == FULL_PAGES and seq.parking.cached_pages == table[:FULL_PAGES]
    host_kv = seq.parking.host_kv
    assert host_kv.shape[1] == len(table)  # nobody else holds its pages: all of them copied
    host_kv[:, :FULL_PAGES - EVICTED] = -1.0  # what the cache keeps must not come from here
    evicted_tail = host_kv[:, FULL_PAGES - EVICTED:]

    # another sequence needs every free page and two more: the least recently used cached
    # pages, the parked sequence's last two full ones, are evicted and written over
    taken = pool.allocate(len(free_page_ids(pool)) + EVICTED)
    assert stack.cache.stats.evictions == EVICTED
    for cache in pool.caches:
        cache[taken] = 7.0
    pool.free(taken)

    scheduler.resume(seq)
    scheduler.wait_for_copies()  # the async engine: the copy lands on its own stream
    assert seq.phase is Phase.RUNNING and not seq.is_replaying
    resume = stack.copy.started[-1]
    assert resume.kind is CopyKind.RESUME
    assert len(resume.pages) == EVICTED + 1  # the evicted pages and the partial last one
    assert resume.host_buf.data_ptr() == evicted_tail.data_ptr()
    assert seq.parking.restored_pages == FULL_PAGES - EVICTED
    assert seq.page_table[:FULL_PAGES - EVICTED] == table[:FULL_PAGES - EVICTED]
    assert seq.num_computed == PARK_AT
    assert same_bytes(kv_rows(pool, seq.page_table, PARK_AT), before)
    stats = scheduler.stats
    assert seq.parking.mode is PreemptMode.SWAP and stats.n_preempt_cached == 0
    assert stats.n_preempt_swap == stats.n_resume == 1 and stats.n_recompute_tokens == 0
    assert stack.host.held_bytes == 0

    stack.run()
    assert seq.finish_reason == "length" and seq.num_generated == MAX_TOKENS
    assert stack.graphs.replays == stack.decode_steps > 0  # decode steps ran in graphs

    unparked = Stack(smollm2, num_pages=32, copy=copy)
    reference = LogitsRecorder()
    never = make_seq("never parked", prompt, max_tokens=MAX_TOKENS, constraint=reference)
    unparked.run(never)
    assert seq.generated_ids == never.generated_ids
    assert len(recorder.logits) == len(reference.logits) == MAX_TOKENS
    assert all(same_bytes(a, b) for a, b in zip(recorder.logits, reference.logits))
    assert pool.num_free_pages == unparked.pool.num_free_pages  # nothing leaked
