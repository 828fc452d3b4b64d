"""Graph buckets and padding (pure), and the decode graph runner's logic on the CPU.

On the CPU a "capture" records the forward and a "replay" re-runs it on the same static
buffers, through the fake FlashInfer, whose graph-mode wrappers read their fixed buffers at run
time like a replayed kernel. What is checked: the right bucket runs, padding rows never touch
real pages, and the hidden states equal an eager step with the torch backend.
"""

import sys
from pathlib import Path

import pytest
import torch

from kvpark.kernels.attention import StepLayout
from kvpark.kernels.flashinfer_paged import AttentionShape, FlashInferPagedAttention
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.model.config import ModelConfig
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.synthetic import synthetic_weights
from kvpark.pod.worker.cuda_graphs import (
    DecodeGraphRunner,
    choose_bucket,
    get_buckets,
    pad_decode_inputs,
    pad_decode_layout,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_flashinfer  # noqa: E402


@pytest.mark.parametrize("max_batch,expected", [
    (1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]),
    (64, [1, 2, 4, 8, 16, 32, 64]), (100, [1, 2, 4, 8, 16, 32, 64, 100]),
])
def test_buckets_up_to_parallel(max_batch, expected):
    assert get_buckets(max_batch) == expected


@pytest.mark.parametrize("n,bucket", [(1, 1), (2, 2), (3, 4), (5, 6), (6, 6), (7, None)])
def test_bucket_choice(n, bucket):
    assert choose_bucket(n, [1, 2, 4, 6]) == bucket


def test_padding_rows_write_only_the_scratch_page():
    layout = StepLayout([[3, 4], [9]], [5, 2], [1, 1], page_size=4)
    padded = pad_decode_layout(layout, bucket=4, scratch_page=0)
    assert padded.page_tables == [[3, 4], [9], [0], [0]]
    assert padded.kv_lens == [5, 2, 1, 1] and padded.q_lens == [1, 1, 1, 1]
    assert pad_decode_inputs([11, 12], [4, 1], 4) == ([11, 12, 0, 0], [4, 1, 0, 0])
    with pytest.raises(AssertionError, match="only decode"):
        pad_decode_layout(StepLayout([[1]], [3], [2], 4), 4, 0)
    with pytest.raises(AssertionError, match="do not fit"):
        pad_decode_layout(layout, 1, 0)


CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=1, head_dim=8)


def eager_capture(forward, mempool):
    """CPU stand-in for CUDA-graph capture: replay re-runs the forward into the static output."""
    hidden = forward()

    def replay():
        with torch.inference_mode():  # the forward's output is an inference tensor
            hidden.copy_(forward())

    return replay, hidden


def make_pool() -> KVPool:
    return KVPool(CONFIG.num_layers, num_pages=24, page_size=4,
                  num_kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim)


# three sequences with fixed page tables (room for a few decode tokens each)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [1, 2], "c": [3, 4, 5, 6, 7, 8, 9, 10]}
TABLES = {"a": [1, 2], "b": [3], "c": [4, 5, 6]}


def prefill(model, pool):
    """The prompts' K/V into `pool`, with the torch backend."""
    assert pool.allocate(6) == [1, 2, 3, 4, 5, 6], "page 0 must already be taken"
    backend = TorchPagedAttention()
    lens = [len(ids) for ids in PROMPTS.values()]
    backend.plan(StepLayout(list(TABLES.values()), lens, lens, pool.page_size))
    ids = [t for prompt in PROMPTS.values() for t in prompt]
    positions = [p for n in lens for p in range(n)]
    model(torch.tensor(ids), torch.tensor(positions), backend, pool.caches)


def test_graph_runner_matches_eager_torch_steps(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    model = LlamaModel(CONFIG, synthetic_weights(CONFIG), batch_invariant=False)
    graph_pool, eager_pool = make_pool(), make_pool()
    shape = AttentionShape(CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim, 4,
                           torch.float32, torch.float32)
    backend = FlashInferPagedAttention("cpu", shape=shape, workspace_bytes=1024)
    runner = DecodeGraphRunner(model, graph_pool, backend, max_batch=4, capture=eager_capture)
    assert runner.scratch_page == 0
    eager_pool.allocate(1)  # keep page ids the same in both pools
    runner.capture_all()
    assert backend.graph_batch_sizes == [1, 2, 4]
    graph_pool.caches[0][runner.scratch_page] = 0  # forget what capture wrote there
    prefill(model, graph_pool)
    prefill(model, eager_pool)
    lens = {n: len(ids) for n, ids in PROMPTS.items()}
    eager = TorchPagedAttention()
    # bucket 1; bucket 2; bucket 4 with one padding row (and "b" opening no new page)
    for names, new in ((["b"], [11]), (["a", "c"], [12, 13]), (["c", "b", "a"], [14, 15, 16])):
        positions = [lens[n] for n in names]
        layout = StepLayout([TABLES[n] for n in names], [p + 1 for p in positions],
                            [1] * len(names), 4)
        hidden = runner.run(new, positions, layout)
        assert hidden.shape == (len(names), CONFIG.hidden_size)
        eager.plan(layout)
        expected = model(torch.tensor(new), torch.tensor(positions), eager, eager_pool.caches)
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-5)
        for n in names:
            lens[n] += 1
    real = [p for table in TABLES.values() for p in table]
    for graph_cache, eager_cache in zip(graph_pool.caches, eager_pool.caches):
        torch.testing.assert_close(graph_cache[real], eager_cache[real], rtol=0, atol=1e-6)
        assert torch.count_nonzero(graph_cache[7:]) == 0  # no real or padding write elsewhere
    assert torch.count_nonzero(graph_pool.caches[0][runner.scratch_page]) > 0  # the padding row
    free_before = graph_pool.num_free_pages
    runner.close()
    assert graph_pool.num_free_pages == free_before + 1


def test_graph_runner_refuses_prefill_and_oversized_batches(monkeypatch):
    fake_flashinfer.install(monkeypatch)
    model = LlamaModel(CONFIG, synthetic_weights(CONFIG), batch_invariant=False)
    pool = make_pool()
    shape = AttentionShape(4, 1, 8, 4, torch.float32, torch.float32)
    runner = DecodeGraphRunner(model, pool, FlashInferPagedAttention("cpu", shape=shape,
                               workspace_bytes=1024), max_batch=2, capture=eager_capture)
    decode = StepLayout([[1], [2]], [2, 2], [1, 1], 4)
    assert not runner.can_run(decode)  # nothing captured yet
    runner.capture_all()
    assert runner.can_run(decode)
    assert not runner.can_run(StepLayout([[1]], [3], [2], 4))
    assert not runner.can_run(StepLayout([[1], [2], [3]], [1, 1, 1], [1, 1, 1], 4))


def test_graph_runner_needs_a_capturable_backend():
    model = LlamaModel(CONFIG, synthetic_weights(CONFIG), batch_invariant=False)
    with pytest.raises(AssertionError, match="cannot be captured"):
        DecodeGraphRunner(model, make_pool(), TorchPagedAttention(), max_batch=2)
