"""The paged attention backends of the CPU (the torch reference and the C kernel) against plain
causal attention on contiguous tensors."""

import random

import pytest
import torch

from kvpark.kernels import cpu_paged
from kvpark.kernels.attention import StepLayout, get_plan_arrays
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.kernels.torch_paged import TorchPagedAttention

BACKENDS = [
    pytest.param(TorchPagedAttention, id="torch"),
    pytest.param(CpuPagedAttention, id="cpu", marks=pytest.mark.skipif(
        not cpu_paged.is_available(), reason="no working C compiler for the CPU kernel")),
]


def plain_causal_attention(q, k, v, q_offset):
    """q: [q_len, Hq, D]; k, v: [kv_len, Hkv, D]; query i sits at position q_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    q_pos = torch.arange(q.shape[0])[:, None] + q_offset
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def run_two_steps(prior_lens, q_lens, hq, hkv, d, page_size, shuffle, seed,
                  make_backend=TorchPagedAttention):
    """Step 1 writes each sequence's prior KV; step 2 appends q_lens tokens and attends."""
    gen = torch.Generator().manual_seed(seed)
    totals = [p + q for p, q in zip(prior_lens, q_lens)]
    pages_needed = [(t + page_size - 1) // page_size for t in totals]
    page_ids = list(range(sum(pages_needed) + 3))
    if shuffle:
        random.Random(seed).shuffle(page_ids)
    tables, start = [], 0
    for n in pages_needed:
        tables.append(page_ids[start : start + n])
        start += n
    cache = torch.zeros(len(page_ids), 2, page_size, hkv, d)
    ks = [torch.randn(t, hkv, d, generator=gen) for t in totals]
    vs = [torch.randn(t, hkv, d, generator=gen) for t in totals]
    qs = [torch.randn(q, hq, d, generator=gen) for q in q_lens]
    backend = make_backend()
    prior = [i for i, p in enumerate(prior_lens) if p > 0]
    if prior:
        backend.plan(StepLayout([tables[i] for i in prior], [prior_lens[i] for i in prior],
                                [prior_lens[i] for i in prior], page_size))
        backend.append_kv(cache, torch.cat([ks[i][: prior_lens[i]] for i in prior]),
                          torch.cat([vs[i][: prior_lens[i]] for i in prior]))
    backend.plan(StepLayout(tables, totals, list(q_lens), page_size))
    backend.append_kv(cache, torch.cat([k[p:] for k, p in zip(ks, prior_lens)]),
                      torch.cat([v[p:] for v, p in zip(vs, prior_lens)]))
    out = backend.attend(torch.cat(qs), cache)
    expected = torch.cat([plain_causal_attention(q, k, v, p)
                          for q, k, v, p in zip(qs, ks, vs, prior_lens)])
    return out, expected


def relative_error(out, expected):
    return ((out - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (6, 1, 8),
                                      (8, 2, 128)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_mixed_batch_matches_plain_attention(make_backend, hq, hkv, d, shuffle):
    # prefill from empty, prefill continuing a prefix, decode at a page boundary, decode inside
    # a partial page, a one-token prompt, and a prefill longer than the C kernel's row tile (8)
    prior_lens = [0, 21, 16, 37, 0, 5]
    q_lens = [19, 12, 1, 1, 1, 30]
    out, expected = run_two_steps(prior_lens, q_lens, hq, hkv, d, 16, shuffle, seed=hq * d,
                                  make_backend=make_backend)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("make_backend", BACKENDS)
@pytest.mark.parametrize("seed", range(8))
def test_random_shapes_match_plain_attention(make_backend, seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3])
    hq = hkv * rng.choice([1, 2, 3, 4])
    d = rng.choice([8, 16, 24, 64])  # 24: a head_dim with a tail past the C kernel's 16 lanes
    page_size = rng.choice([1, 4, 16])
    n = rng.randint(1, 6)
    prior_lens = [rng.choice([0, rng.randint(1, 70)]) for _ in range(n)]
    q_lens = [rng.choice([1, rng.randint(1, 40)]) for _ in range(n)]
    out, expected = run_two_steps(prior_lens, q_lens, hq, hkv, d, page_size, True, seed,
                                  make_backend=make_backend)
    assert relative_error(out, expected) < 1e-5


def test_plan_arrays_hand_computed():
    layout = StepLayout(page_tables=[[7, 2], [5], [0, 1, 3]], kv_lens=[20, 3, 33],
                        q_lens=[4, 1, 2], page_size=16)
    arrays = get_plan_arrays(layout)
    assert arrays.qo_indptr.tolist() == [0, 4, 5, 7]
    assert arrays.kv_indptr.tolist() == [0, 2, 3, 6]
    assert arrays.kv_indices.tolist() == [7, 2, 5, 0, 1, 3]
    assert arrays.kv_last_page_len.tolist() == [4, 3, 1]
    assert arrays.batch_indices.tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert arrays.positions.tolist() == [16, 17, 18, 19, 2, 31, 32]


def test_append_writes_only_the_new_slots():
    backend = TorchPagedAttention()
    cache = torch.zeros(4, 2, 4, 1, 2)
    backend.plan(StepLayout([[3, 1]], [6], [3], 4))
    k = torch.arange(6.0).view(3, 1, 2) + 1
    backend.append_kv(cache, k, -k)
    written = (cache != 0).any(-1).any(-1)  # [pages, 2, page_size]
    assert written[3, :, 3].all() and written[1, :, :2].all()
    assert written.sum().item() == 6
    assert torch.equal(cache[1, 0, 1, 0], torch.tensor([5.0, 6.0]))
