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


# --- a step's whole token mixing in one call (`delta_net_mix_c`) ---

HK, HV, DK, DV, KERNEL, SLOTS = 2, 4, 12, 20, 4, 6  # two value heads share each key head;
# 12 and 40 channels a task: SiLU lanes and a tail (8 lanes on AVX2, 16 on AVX-512)
CONV_DIM = 2 * HK * DK + HV * DV


def mix_inputs(rows: int, seed: int = 1, kernel: int = KERNEL):
    """A projection's rows (mixed channels, a, b as strided views of one tensor, as the layer's
    split gives them), the layer's conv weight and rates, and random starting states."""
    g = torch.Generator().manual_seed(seed)
    projected = torch.randn(rows, CONV_DIM + 2 * HV + 5, generator=g)
    mixed, a, b = projected[:, :CONV_DIM], projected[:, CONV_DIM:CONV_DIM + HV], \
        projected[:, CONV_DIM + HV:CONV_DIM + 2 * HV]
    conv_w = torch.randn(CONV_DIM, kernel, generator=g) * 0.5
    neg_a, dt_bias = -torch.rand(HV, generator=g) - 0.1, torch.randn(HV, generator=g)
    conv_states = torch.randn(SLOTS, CONV_DIM, kernel - 1, generator=g)
    states = torch.randn(SLOTS, HV, DK, DV, generator=g) * 0.1
    return mixed, a, b, conv_w, neg_a, dt_bias, conv_states, states


def torch_mix(mixed, a, b, conv_w, neg_a, dt_bias, conv_state, state):
    """The reference: the layer's torch ops around the torch rule, for one sequence's rows."""
    qkv = delta_rule.causal_conv(mixed, conv_state, conv_w)
    q, k, v = qkv.split((HK * DK, HK * DK, HV * DV), dim=-1)
    q = delta_rule.l2_normalize(q.reshape(-1, HK, DK)).repeat_interleave(HV // HK, dim=1)
    k = delta_rule.l2_normalize(k.reshape(-1, HK, DK)).repeat_interleave(HV // HK, dim=1)
    return delta_rule.gated_delta_rule(q * DK ** -0.5, k, v.reshape(-1, HV, DV), a, b, neg_a,
                                       dt_bias, state)


def c_mix(isa, inputs, spans, rows: int):
    mixed, a, b, conv_w, neg_a, dt_bias, conv_states, states = inputs
    out = torch.zeros(rows, HV, DV)
    delta_rule.delta_net_mix_c(mixed, a, b, conv_w, neg_a, dt_bias, conv_states, states,
                               delta_rule.make_spans(spans, SLOTS), out, HK, isa=isa)
    return out


@pytest.fixture
def c_isa(isa):
    if not delta_rule.is_available(isa):
        pytest.skip("no working C compiler for the kernels")
    return isa


@pytest.mark.parametrize("kernel", [KERNEL, 3])  # Qwen3.5's conv width, and another
def test_the_step_mix_matches_the_torch_ops(c_isa, kernel):
    """Three sequences in one call (a 9-row prompt chunk and two decode rows) against the
    layer's torch ops run a sequence at a time."""
    inputs = mix_inputs(11, kernel=kernel)
    spans = [(4, 0, 9), (1, 9, 1), (0, 10, 1)]
    ref_conv, ref_states = inputs[6].clone(), inputs[7].clone()
    first_states = ref_states.clone()
    out = c_mix(c_isa, inputs, spans, 11)
    mixed, a, b, conv_w, neg_a, dt_bias, conv_states, states = inputs
    for slot, start, num_rows in spans:
        rows = slice(start, start + num_rows)
        ref = torch_mix(mixed[rows], a[rows], b[rows], conv_w, neg_a, dt_bias, ref_conv[slot],
                        ref_states[slot])
        assert (out[rows] - ref).abs().max().item() < 2e-5
    assert torch.equal(conv_states, ref_conv)  # the last inputs, copied
    assert (states - ref_states).abs().max().item() < 1e-5
    untouched = [2, 3, 5]
    assert torch.equal(states[untouched], first_states[untouched])


def test_a_rows_bits_depend_only_on_its_own_sequence(c_isa):
    """Sequence A's 7 rows as one prompt chunk alone, then as 7 decode rows each in a call with
    other sequences before and after it at 1 and 3 kernel threads: the same bits, rows and
    final states."""
    rows = 7
    alone = mix_inputs(rows)
    chunk = c_mix(c_isa, alone, [(2, 0, rows)], rows)
    mixed, a, b, conv_w, neg_a, dt_bias, conv_states, states = mix_inputs(rows)
    others = mix_inputs(3, seed=2)
    before = worker_pool.get_num_threads()
    decoded = []
    try:
        for t in range(rows):
            worker_pool.set_num_threads(1 + 2 * (t % 2))
            # A's row between two other sequences' rows
            step = [others[0][t % 3:t % 3 + 1], mixed[t:t + 1], others[0][(t + 1) % 3:][:1]]
            ab = [(others[1][t % 3:t % 3 + 1], others[2][t % 3:t % 3 + 1]), (a[t:t + 1],
                  b[t:t + 1]), (others[1][(t + 1) % 3:][:1], others[2][(t + 1) % 3:][:1])]
            out = torch.zeros(3, HV, DV)
            delta_rule.delta_net_mix_c(
                torch.cat(step), torch.cat([x for x, _ in ab]), torch.cat([y for _, y in ab]),
                conv_w, neg_a, dt_bias, conv_states, states,
                delta_rule.make_spans([(0, 0, 1), (2, 1, 1), (5, 2, 1)], SLOTS), out, HK, isa=c_isa)
            decoded.append(out[1:2])
    finally:
        worker_pool.set_num_threads(before)
    assert torch.equal(torch.cat(decoded), chunk)
    assert torch.equal(conv_states[2], alone[6][2]) and torch.equal(states[2], alone[7][2])


@pytest.mark.parametrize("spans", [[(0, 2, 3)], [(SLOTS, 0, 1)], [(1, 0, 1), (1, 1, 1)]],
                         ids=["past-the-rows", "past-the-slots", "one-slot-twice"])
def test_the_step_mix_refuses_spans_the_kernel_would_misread(c_isa, spans):
    """The C kernel trusts its spans with pointer arithmetic (and runs a slot's tasks at once)."""
    inputs = mix_inputs(4)
    before = [t.clone() for t in inputs[6:]]
    with pytest.raises(AssertionError):
        c_mix(c_isa, inputs, spans, 4)
    assert all(torch.equal(t, u) for t, u in zip(inputs[6:], before))
