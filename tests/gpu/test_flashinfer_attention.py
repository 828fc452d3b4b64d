"""FlashInfer against the torch reference backend on the same pool (bf16, NHD, page size 16)."""

import random

import pytest
import torch
from gpu_common import DEVICE, DTYPE

from kvpark.kernels.attention import StepLayout, get_plan_arrays
from kvpark.kernels.flashinfer_paged import AttentionShape, FlashInferPagedAttention
from kvpark.kernels.torch_paged import TorchPagedAttention

pytestmark = pytest.mark.gpu

PAGE_SIZE = 16
NUM_PAGES = 160
MAX_REL_ERR = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_layout(rng: random.Random, decode_only: bool) -> StepLayout:
    """Fresh prompts, prefix-continuing chunks and decodes, with partial and exact last pages."""
    n = rng.randint(2, 7)
    prior = [rng.choice([0, 15, 16, 17, rng.randint(1, 200)]) for _ in range(n)]
    if decode_only:
        prior = [max(p, 1) for p in prior]
        q_lens = [1] * n
    else:
        q_lens = [rng.choice([1, 1, 16, rng.randint(2, 90)]) for _ in range(n)]
    totals = [p + q for p, q in zip(prior, q_lens)]
    pages = list(range(NUM_PAGES))
    rng.shuffle(pages)
    tables, start = [], 0
    for total in totals:
        count = -(-total // PAGE_SIZE) + rng.choice([0, 1])  # sometimes a page not reached yet
        tables.append(pages[start : start + count])
        start += count
    return StepLayout(tables, totals, q_lens, PAGE_SIZE)


def run_step(backend, layout, caches, q, k, v):
    backend.plan(layout)
    outs = []
    for cache in caches:  # two layers: plan once, run per layer
        backend.append_kv(cache, k, v)
        outs.append(backend.attend(q, cache))
    return outs


@pytest.mark.parametrize("hq,hkv", [(9, 3), (12, 4), (32, 8)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_matches_torch_backend(flashinfer, hq, hkv, head_dim, decode_only, seed):
    rng = random.Random(seed * 1000 + hq * head_dim)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    layout = random_layout(rng, decode_only)
    base = torch.randn(2, NUM_PAGES, 2, PAGE_SIZE, hkv, head_dim, generator=gen, device=DEVICE,
                       dtype=DTYPE)
    t = layout.num_tokens
    q = torch.randn(t, hq, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
    k = torch.randn(t, hkv, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
    v = torch.randn(t, hkv, head_dim, generator=gen, device=DEVICE, dtype=DTYPE)
    fi_caches, ref_caches = list(base.clone()), list(base.clone())
    shape = AttentionShape(hq, hkv, head_dim, PAGE_SIZE, DTYPE, DTYPE)
    fi_outs = run_step(FlashInferPagedAttention(DEVICE, shape), layout, fi_caches, q, k, v)
    ref_outs = run_step(TorchPagedAttention(DEVICE), layout, ref_caches, q, k, v)
    for fi_cache, ref_cache in zip(fi_caches, ref_caches):
        assert torch.equal(fi_cache, ref_cache), "append wrote different slots"
    for fi_out, ref_out in zip(fi_outs, ref_outs):
        assert rel_err(fi_out, ref_out) < MAX_REL_ERR


def test_lazy_shape_equals_configured(flashinfer):
    rng, gen = random.Random(7), torch.Generator(device=DEVICE).manual_seed(7)
    layout = random_layout(rng, decode_only=False)
    base = torch.randn(1, NUM_PAGES, 2, PAGE_SIZE, 2, 64, generator=gen, device=DEVICE,
                       dtype=DTYPE)
    q = torch.randn(layout.num_tokens, 8, 64, generator=gen, device=DEVICE, dtype=DTYPE)
    kv = torch.randn(layout.num_tokens, 2, 64, generator=gen, device=DEVICE, dtype=DTYPE)
    lazy = run_step(FlashInferPagedAttention(DEVICE), layout, list(base.clone()), q, kv, kv)
    shape = AttentionShape(8, 2, 64, PAGE_SIZE, DTYPE, DTYPE)
    eager = run_step(FlashInferPagedAttention(DEVICE, shape), layout, list(base.clone()), q, kv,
                     kv)
    assert torch.equal(lazy[0], eager[0])


def test_our_batch_indices_and_positions_equal_flashinfers(flashinfer):
    layout = random_layout(random.Random(3), decode_only=False)
    arrays = get_plan_arrays(layout, DEVICE)
    seq_lens = flashinfer.get_seq_lens(arrays.kv_indptr, arrays.kv_last_page_len, PAGE_SIZE)
    batch_indices, positions = flashinfer.get_batch_indices_positions(
        arrays.qo_indptr, seq_lens, layout.num_tokens)
    assert torch.equal(batch_indices, arrays.batch_indices)
    assert torch.equal(positions, arrays.positions)


@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_graph_wrapper_replays_after_replan(flashinfer, hq, hkv, head_dim):
    """Capture append + attend once for 4 rows; re-plan other layouts; replay; compare."""
    bucket = 4
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, hkv, head_dim, generator=gen, device=DEVICE,
                        dtype=DTYPE)
    backend = FlashInferPagedAttention(DEVICE, AttentionShape(hq, hkv, head_dim, PAGE_SIZE,
                                                              DTYPE, DTYPE))
    backend.prepare_graph(bucket, NUM_PAGES)
    q = torch.zeros(bucket, hq, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.zeros(bucket, hkv, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.zeros_like(k)
    layouts = [StepLayout([[0], [1], [2], [3]], [1, 1, 1, 1], [1] * 4, PAGE_SIZE),
               StepLayout([[10, 11], [12], [20, 21, 22], [30]], [17, 16, 40, 3], [1] * 4,
                          PAGE_SIZE),
               StepLayout([[40, 41, 42, 43, 44], [50], [60, 61], [70]], [80, 1, 32, 9],
                          [1] * 4, PAGE_SIZE)]
    backend.plan_graph(layouts[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            backend.append_kv(cache, k, v)
            backend.attend(q, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.append_kv(cache, k, v)
        out = backend.attend(q, cache)
    for layout in layouts[1:]:
        for static in (q, k, v):
            static.copy_(torch.randn(static.shape, generator=gen, device=DEVICE, dtype=DTYPE))
        expected_cache = cache.clone()
        reference = TorchPagedAttention(DEVICE)
        reference.plan(layout)
        reference.append_kv(expected_cache, k, v)
        expected = reference.attend(q, expected_cache)
        backend.plan_graph(layout)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, expected_cache)
        assert rel_err(out, expected) < MAX_REL_ERR
