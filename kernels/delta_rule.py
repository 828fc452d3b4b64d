"""The Gated DeltaNet token mixer's recurrent parts, per sequence, in torch: the causal depthwise
conv over the last few inputs, and the gated delta rule over a [heads, k_dim, v_dim] state.

Both are written one token at a time on fixed shapes, the same ops whether a row is a prompt row
or a decode row and whatever else shares the step: so a row's bits depend only on its own
sequence's history, and a recompute replay rebuilds the first pass's state bit for bit. (The
chunked form of the delta rule that long prompts usually take is faster but sums in another
order; it would break that promise.) The C kernel (`delta_rule.c`, when built) computes the
same recurrence per (sequence, head) with its own fixed order, and `delta_net_mix_c` a whole
step's conv, norms and recurrence for every sequence in one call; this file is their reference.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import worker_pool
from .cbuild import KernelUnavailable, load_library
from .cpu_features import Isa

L2_EPS = 1e-6  # as flash-linear-attention's and transformers' l2norm


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / ||x|| over the last dim (with transformers' epsilon inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv then SiLU over one sequence's new rows.

    x: [T, C] new inputs; state: [C, K - 1] the inputs before them (zeros at a sequence's start),
    updated in place to the last K - 1 inputs; weight: [C, K]. Each output is the same chain of
    multiplies and adds, oldest input first, whatever T is.
    """
    num_rows, kernel = x.shape[0], weight.shape[1]
    window = torch.cat((state.t().to(x.dtype), x))  # [K - 1 + T, C]
    out = window[0:num_rows] * weight[:, 0]
    for j in range(1, kernel):
        out = out + window[j:j + num_rows] * weight[:, j]
    state.copy_(window[num_rows:].t())
    return F.silu(out)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule over one sequence's rows, one token at a time.

    q, k: [T, H, Dk] (l2-normalised, q already scaled by Dk^-1/2); v: [T, H, Dv]; a, b: [T, H]
    the decay step and beta before their activations; neg_a, dt_bias: [H]; state: [H, Dk, Dv]
    float32, updated in place. Per token: g = -e^A softplus(a + dt_bias), beta = sigmoid(b);
    S = S e^g; S += k (beta (v - k S)); o = q S. Returns o: [T, H, Dv] float32.
    """
    q, k, v, a, b = q.float(), k.float(), v.float(), a.float(), b.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    # every op on one token's [H] or [H, Dk, Dv]: vectorised transcendental functions (exp,
    # softplus, sigmoid) round their tail elements differently from the body, so a [T, H] op
    # would give a row bits that depend on T. And products then a sum over Dk, not a matmul:
    # a BLAS picks its summation order by the operands' alignment.
    for t in range(q.shape[0]):
        decay = (neg_a * F.softplus(a[t] + dt_bias)).exp()
        beta = torch.sigmoid(b[t])
        state.mul_(decay[:, None, None])
        kv_mem = (state * k[t][:, :, None]).sum(1)  # [H, Dv]
        delta = (v[t] - kv_mem) * beta[:, None]
        state.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = (state * q[t][:, :, None]).sum(1)
    return out


@functools.cache
def load_kernel(isa: Isa | None = None) -> ctypes.CDLL:
    """The kernels library for `isa` (default: the best this CPU has), the delta rule typed."""
    lib = load_library(isa)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.kvpark_gated_delta_rule.argtypes = [ptr] * 9 + [i32] * 5
    lib.kvpark_gated_delta_rule.restype = None
    i64, f32 = ctypes.c_int64, ctypes.c_float
    lib.kvpark_delta_net_mix.argtypes = ([ptr, i64, ptr, ptr, i64] + [ptr] * 7 + [i32] * 6
                                         + [f32, i32])
    lib.kvpark_delta_net_mix.restype = None
    return lib


def is_available(isa: Isa | None = None) -> bool:
    try:
        load_kernel(isa)
        return True
    except KernelUnavailable:
        return False


def gated_delta_rule_c(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                       state: torch.Tensor, isa: Isa | None = None) -> torch.Tensor:
    """`gated_delta_rule` in C (`csrc/delta_rule.c`): the same recurrence, a fixed order of its
    own per (token, head), value heads split over the kernel threads. CPU float32 only; `state`
    must be dense (a state slot is)."""
    assert state.is_contiguous() and state.dtype == torch.float32 and state.is_cpu
    q, k, v, a, b = (t.float().contiguous() for t in (q, k, v, a, b))
    rows, heads, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(rows, heads, dv)
    neg_a, dt_bias = neg_a.float().contiguous(), dt_bias.float().contiguous()
    load_kernel(isa).kvpark_gated_delta_rule(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), a.data_ptr(), b.data_ptr(), neg_a.data_ptr(),
        dt_bias.data_ptr(), state.data_ptr(), out.data_ptr(), rows, heads, dk, dv,
        worker_pool.get_num_threads())
    return out


Span = tuple[int, int, int]  # one sequence's rows in a step: (state slot, first row, rows)


@dataclass(frozen=True)
class Spans:
    """The sequences of a step's mixing call, checked and laid out once a step (every DeltaNet
    layer reads the same): each slot inside the state pool and at most once (the C kernel runs
    a slot's tasks at once)."""

    spans: tuple[Span, ...]
    table: torch.Tensor  # int32 [n, 3]: what the C kernel reads
    num_slots: int
    rows_end: int  # one past the last row a span reads


def make_spans(spans: Sequence[Span], num_slots: int) -> Spans:
    slots = [span[0] for span in spans]
    assert len(set(slots)) == len(slots), "two spans of one slot in a call"
    assert all(0 <= slot < num_slots and 0 <= start and 0 <= n for slot, start, n in spans), (
        "a span outside the slots")
    return Spans(tuple(spans), torch.tensor(spans, dtype=torch.int32).reshape(-1, 3), num_slots,
                 max((start + n for _, start, n in spans), default=0))


def delta_net_mix_c(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    conv_weight: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor,
                    conv_states: torch.Tensor, states: torch.Tensor, spans: Spans,
                    out: torch.Tensor, num_k_heads: int, isa: Isa | None = None) -> None:
    """A step's token mixing in one C call: for each span, `causal_conv` of its rows from its
    slot's conv state, `l2_normalize` of q and k (q times Dk^-1/2) and `gated_delta_rule` from
    its slot's state, into `out`'s rows. The same per-row arithmetic whatever the spans and the
    thread count (csrc/delta_rule.c). CPU float32 only.

    mixed: [rows, conv_dim] (q, k, v channels); a, b: [rows, H] (rows may be strided, as the
    views of one projection are); conv_weight: [conv_dim, K]; neg_a, dt_bias: [H];
    conv_states: [slots, conv_dim, K - 1]; states: [slots, H, Dk, Dv]; out: [rows, H, Dv]."""
    if not spans.spans:
        return
    if a.stride(-1) != 1 or b.stride(-1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    dense = (conv_weight, neg_a, dt_bias, conv_states, states, out)
    assert all(t.is_contiguous() for t in dense) and mixed.stride(-1) == 1
    assert all(t.dtype == torch.float32 and t.is_cpu for t in (mixed, a, b, *dense))
    num_slots, heads, dk, dv = states.shape
    conv_dim, kernel = conv_weight.shape
    # the C kernel trusts these shapes with its pointer arithmetic
    assert heads % num_k_heads == 0 and conv_dim == 2 * num_k_heads * dk + heads * dv
    assert mixed.shape[1] >= conv_dim and a.shape[1] >= heads and b.shape[1] >= heads
    assert conv_states.shape == (num_slots, conv_dim, kernel - 1)
    assert out.shape[1:] == (heads, dv) and neg_a.numel() == dt_bias.numel() == heads
    rows = min(mixed.shape[0], a.shape[0], b.shape[0], out.shape[0])
    assert spans.num_slots == num_slots and spans.rows_end <= rows, "spans of another step"
    load_kernel(isa).kvpark_delta_net_mix(
        mixed.data_ptr(), mixed.stride(0), a.data_ptr(), b.data_ptr(), a.stride(0),
        conv_weight.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(), conv_states.data_ptr(),
        states.data_ptr(), out.data_ptr(), spans.table.data_ptr(), len(spans.spans), num_k_heads,
        heads, dk, dv, kernel, dk ** -0.5, worker_pool.get_num_threads())
