"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode batch of n rows runs the graph of the smallest bucket >= n (1, 2, 4, ... up to
`--parallel`). The extra rows are padding: one token each at position 0 of a scratch page the
runner owns, so they never touch a real sequence's KV. Before each replay the bucket's static
inputs are refilled and the FlashInfer wrapper is re-planned outside the graph into the
fixed-address buffers the captured kernels read.

Bucket choice and padding are pure functions (tested on the CPU); capture runs only on CUDA,
or through an injected `capture` function in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpark.kernels.attention import AttentionBackend, StepLayout

from ..memory.kv_pool import KVPool
from ..model.llama import LlamaModel

WARMUP_RUNS = 2  # before capture: lets lazy inits (cuBLAS handles, FlashInfer modules) happen
PAD_TOKEN_ID = 0


# ---- buckets and padding (pure) ------------------------------------------------------------------
def get_buckets(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself: every batch has a bucket."""
    assert max_batch >= 1, f"max_batch {max_batch} must be >= 1"
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return [*buckets, max_batch]


def choose_bucket(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `num_seqs` rows; None when the batch is too large."""
    assert num_seqs >= 1, "an empty batch has no bucket"
    return next((b for b in sorted(buckets) if b >= num_seqs), None)


def pad_decode_layout(layout: StepLayout, bucket: int, scratch_page: int) -> StepLayout:
    """`layout` plus padding rows that each write one token at position 0 of `scratch_page`."""
    assert layout.is_decode_only, "only decode steps are padded into graphs"
    assert layout.num_seqs <= bucket, f"{layout.num_seqs} rows do not fit bucket {bucket}"
    pad = bucket - layout.num_seqs
    return StepLayout(
        page_tables=[*layout.page_tables, *([[scratch_page]] * pad)],
        kv_lens=[*layout.kv_lens, *([1] * pad)],
        q_lens=[*layout.q_lens, *([1] * pad)],
        page_size=layout.page_size,
    )


def pad_decode_inputs(input_ids: list[int], positions: list[int],
                      bucket: int) -> tuple[list[int], list[int]]:
    assert len(input_ids) == len(positions) <= bucket, "inputs do not fit the bucket"
    pad = bucket - len(input_ids)
    return [*input_ids, *([PAD_TOKEN_ID] * pad)], [*positions, *([0] * pad)]


def get_dummy_layout(bucket: int, scratch_page: int, page_size: int) -> StepLayout:
    """The layout graphs are warmed up and captured with: every row is padding."""
    return StepLayout([[scratch_page]] * bucket, [1] * bucket, [1] * bucket, page_size)


# ---- capture -----------------------------------------------------------------------------------
# (forward, memory pool) -> (replay, static output of the captured forward)
CaptureFn = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]


def capture_cuda_graph(forward: Callable[[], torch.Tensor],
                       mempool: object) -> tuple[Callable[[], None], torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        hidden = forward()
    return graph.replay, hidden


@dataclass(frozen=True)
class CapturedDecode:
    bucket: int
    replay: Callable[[], None]
    input_ids: torch.Tensor  # [bucket] static input
    positions: torch.Tensor  # [bucket] static input
    hidden: torch.Tensor  # [bucket, hidden] static output, rewritten by every replay


class DecodeGraphRunner:
    """Captures `model`'s decode forward per bucket and replays it for decode-only steps."""

    def __init__(self, model: LlamaModel, pool: KVPool, backend: AttentionBackend,
                 max_batch: int, capture: CaptureFn | None = None) -> None:
        assert backend.can_capture_graphs, f"the {backend.name} backend cannot be captured"
        self.model = model
        self.pool = pool
        self.backend = backend
        self.buckets = get_buckets(max_batch)
        self._capture = capture or capture_cuda_graph
        self.scratch_page = pool.allocate(1)[0]  # padding rows write their K/V here
        self._graphs: dict[int, CapturedDecode] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def capture_all(self) -> None:
        # largest first, so smaller graphs reuse the memory pool the largest one grew
        mempool = torch.cuda.graph_pool_handle() if self.pool.device.type == "cuda" else None
        for bucket in reversed(self.buckets):
            self._graphs[bucket] = self._capture_bucket(bucket, mempool)

    def can_run(self, layout: StepLayout) -> bool:
        return (layout.is_decode_only and layout.num_seqs <= self.max_batch
                and len(self._graphs) == len(self.buckets))

    def run(self, input_ids: list[int], positions: list[int], layout: StepLayout) -> torch.Tensor:
        """Hidden states `[n, hidden]` of the n real rows (a view: use it before the next run)."""
        bucket = choose_bucket(layout.num_seqs, self.buckets)
        assert bucket is not None and self.can_run(layout), "not a capturable decode step"
        graph = self._graphs[bucket]
        ids, pos = pad_decode_inputs(input_ids, positions, bucket)
        graph.input_ids.copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        graph.positions.copy_(torch.tensor(pos, dtype=torch.long), non_blocking=True)
        self.backend.plan_graph(pad_decode_layout(layout, bucket, self.scratch_page))
        graph.replay()
        return graph.hidden[: layout.num_seqs]

    def close(self) -> None:
        self._graphs.clear()
        self.pool.free([self.scratch_page])

    def _capture_bucket(self, bucket: int, mempool: object) -> CapturedDecode:
        device = self.pool.device
        input_ids = torch.full((bucket,), PAD_TOKEN_ID, dtype=torch.long, device=device)
        positions = torch.zeros(bucket, dtype=torch.long, device=device)
        self.backend.prepare_graph(bucket, self.pool.num_pages)
        self.backend.plan_graph(get_dummy_layout(bucket, self.scratch_page, self.pool.page_size))

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.backend, self.pool.caches)

        replay, hidden = self._capture(forward, mempool)
        return CapturedDecode(bucket, replay, input_ids, positions, hidden)
