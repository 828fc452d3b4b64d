"""Sampling filters: always a valid distribution, whatever the (validated) parameters."""

import pytest
import torch

from kvpark.pod.requests.sampling_fields import sampling_params
from kvpark.pod.sampling.sampler import SamplingParams, draw, filter_logits, make_generator, sample


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.65, top_p=5e-90, min_p=0.45),  # top_p underflows float32
    SamplingParams(temperature=2.0, top_k=1 << 20),
    SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.9),
    SamplingParams(temperature=1.0, min_p=1.0),
])
def test_filtered_probabilities_are_a_distribution(params):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 5
    probs = filter_logits(logits, params)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(probs.sum().item() - 1) < 1e-5
    assert probs[logits.argmax()] > 0  # the best token always survives


def test_tiny_temperature_is_greedy():
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=0)]
    gens = [make_generator(1), make_generator(2)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_p_zero_at_temperature_one_is_greedy():
    """top_p 0 keeps only the most likely token; it once meant 1.0 (random text)."""
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(3))
    params = sampling_params({"top_p": 0, "temperature": 1}, 4096, ("max_tokens",))
    assert params.top_p == 0.0 and params.is_greedy
    for seed in range(3):
        gens = [make_generator(seed * 100 + row) for row in range(64)]
        assert sample(logits, [params] * 64, gens) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (filter_logits(logits, SamplingParams(top_k=2)) > 0).sum() == 2
    top_p = filter_logits(logits, SamplingParams(top_p=0.7))
    assert (top_p > 0).tolist() == [True, True, False, False, False]


def test_seeded_sampling_repeats():
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=1.0)] * 3
    first = sample(logits, params, [make_generator(s) for s in (1, 2, 3)])
    again = sample(logits, params, [make_generator(s) for s in (1, 2, 3)])
    assert first == again


def full_sort_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k, softmax, min-p and top-p with a full sort of the vocabulary: what
    `filter_logits` computes with its top-p candidates."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, params.top_k).values[-1],
                                    float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        values, order = torch.sort(probs, descending=True)
        drop = (values.cumsum(-1) - values) >= params.top_p
        drop[0] = False
        probs = torch.zeros_like(probs).scatter(-1, order, values.masked_fill(drop, 0.0))
    return probs / probs.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95),  # peaked: the prefix ends among candidates
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # non-zeros < 256
    SamplingParams(temperature=50.0, top_p=0.9),  # nearly flat: the full sort
    SamplingParams(temperature=1.0, min_p=0.2, top_p=0.99),  # min-p leaves < top_p of mass
])
def test_top_p_from_candidates_keeps_what_a_full_sort_keeps(params):
    for seed in range(5):
        logits = torch.randn(49152, generator=torch.Generator().manual_seed(seed)) * 4
        assert torch.equal(filter_logits(logits, params), full_sort_filter(logits, params))


def test_a_draw_follows_the_weights_never_takes_a_zero_and_repeats_per_seed():
    weights = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    generator = make_generator(5)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[draw(weights, generator)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / 4000, weights, atol=0.03)
    first, second = make_generator(9), make_generator(9)
    assert [draw(weights, first) for _ in range(50)] == [draw(weights, second) for _ in range(50)]
    assert draw(torch.tensor([0.0, 1.0, 0.0]), make_generator(1)) == 1
