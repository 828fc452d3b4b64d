"""The gated delta rule's C kernel (each ISA build this CPU runs) against its torch reference,
and the property recompute exactness rests on: a token's bits are the same whether it is fed in
a prompt chunk or alone as a decode row, at any kernel thread count."""

from __future__ import annotations

import pytest
import torch

from kvpark.kernels import delta_rule, worker_pool

torch.set_num_threads(1)


def inputs(rows: int, heads: int = 4, dk: int = 16, dv: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = delta_rule.l2_normalize(torch.randn(rows, heads, dk, generator=g)) * dk ** -0.5
    k = delta_rule.l2_normalize(torch.randn(rows, heads, dk, generator=g))
    v = torch.randn(rows, heads, dv, generator=g)
    a, b = torch.randn(rows, heads, generator=g), torch.randn(rows, heads, generator=g)
    neg_a, dt_bias = -torch.rand(heads, generator=g) - 0.1, torch.randn(heads, generator=g)
    return q, k, v, a, b, neg_a, dt_bias


def run(rule, args, rows: slice | None = None, state=None, **kw):
    q, k, v, a, b, neg_a, dt_bias = args
    state = torch.zeros(q.shape[1], q.shape[2], v.shape[2]) if state is None else state
    rows = rows or slice(None)
    return rule(q[rows], k[rows], v[rows], a[rows], b[rows], neg_a, dt_bias, state, **kw), state


@pytest.fixture
def c_rule(isa):
    if not delta_rule.is_available(isa):
        pytest.skip("no working C compiler for the kernels")
    return lambda *args: delta_rule.gated_delta_rule_c(*args, isa=isa)


def test_the_c_kernel_matches_the_torch_reference(c_rule):
    args = inputs(64)
    (out, state), (ref, ref_state) = run(c_rule, args), run(delta_rule.gated_delta_rule, args)
    assert (out - ref).abs().max().item() < 1e-5
    assert (state - ref_state).abs().max().item() < 1e-5


@pytest.mark.parametrize("rule", ["c", "torch"])
def test_a_prompt_chunk_computes_the_bits_of_decode_rows(c_rule, rule):
    rule = c_rule if rule == "c" else delta_rule.gated_delta_rule
    args = inputs(41)
    chunk, chunk_state = run(rule, args)
    state = torch.zeros_like(chunk_state)
    rows = [run(rule, args, slice(t, t + 1), state)[0] for t in range(41)]
    assert torch.equal(torch.cat(rows), chunk) and torch.equal(state, chunk_state)


def test_the_thread_count_does_not_change_a_bit(c_rule):
    args = inputs(17, heads=8)
    before = worker_pool.get_num_threads()
    try:
        worker_pool.set_num_threads(1)
        one = run(c_rule, args)
        worker_pool.set_num_threads(3)
        three = run(c_rule, args)
    finally:
        worker_pool.set_num_threads(before)
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])


def test_the_state_carries_the_sequence(c_rule):
    """Split anywhere, the second part continues from the first part's state exactly."""
    args = inputs(30)
    whole, _ = run(c_rule, args)
    first, state = run(c_rule, args, slice(0, 11))
    second, _ = run(c_rule, args, slice(11, 30), state)
    assert torch.equal(torch.cat((first, second)), whole)
