"""A decoder layer's block rows in two C calls around the attention (`csrc/layer_ops.c`).

A batch-1 decode step on the CPU paid a per-op overhead on 33 aten ops a layer: a large share
of SmolLM2-135M's step went to norms, RoPE, residual adds and Python (benchmarks/README.md).
`FusedLayer.attention_inputs` (norm, qkv, RoPE) and `FusedLayer.mlp_residual` (o, residual,
norm, gate_up, silu * up, down, residual) do a layer's work for the rows that read the GGUF's
blocks; the linears are the same
`kvpark_quant_linear` calls as `quant_linear`. A row's bits depend on that row alone, whatever
the other rows of the call or the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from . import amx_gemm, worker_pool
from .cbuild import KernelUnavailable, load_library
from .cpu_features import Isa
from .quant_linear import QuantizedWeight

i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


class _QWeight(ctypes.Structure):  # QWeight in csrc/layer_ops.c
    _fields_ = [("kind", ctypes.c_int32), ("out_features", ctypes.c_int32),
                ("in_features", ctypes.c_int32), ("scale", ptr), ("mins", ptr), ("quants", ptr)]


class _Layer(ctypes.Structure):  # Layer in csrc/layer_ops.c
    _fields_ = [("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("intermediate", ctypes.c_int32), ("eps", ctypes.c_float),
                ("input_norm", ptr), ("post_norm", ptr),
                ("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight)]


@functools.cache
def load_kernels(isa: Isa | None = None) -> ctypes.CDLL:
    """The library built for `isa` (default: the best this CPU has), its layer ops typed."""
    lib = load_library(isa)
    lib.kvpark_rms_norm.argtypes = [ptr, i64, i32, i32, ptr, ctypes.c_float, ptr, i64, i32]
    lib.kvpark_rms_norm_tiles.argtypes = [ptr, i64, i32, i32, ptr, ctypes.c_float, ptr, i32,
                                          i32]
    lib.kvpark_rope.argtypes = [ptr, i64, i32, i32, i32, ptr, ptr, i64, i32]
    lib.kvpark_silu_mul.argtypes = [ptr, i64, i32, i32, ptr, i64, i32]
    for fn in (lib.kvpark_rms_norm, lib.kvpark_rope, lib.kvpark_silu_mul):
        fn.restype = None
    lib.kvpark_layer_scratch_floats.argtypes = [ptr, i32]
    lib.kvpark_layer_scratch_floats.restype = i64
    lib.kvpark_layer_pre.argtypes = [ptr, ptr, i64, i32, ptr, ptr, i64, ptr, i64, ptr, i64, i32]
    lib.kvpark_layer_post.argtypes = [ptr, ptr, i64, i32, ptr, i64, ptr, i64, i32]
    lib.kvpark_layer_pre.restype = lib.kvpark_layer_post.restype = i32
    lib.kvpark_decode_layers.argtypes = [ptr, ptr, i32, ptr, i64, i32, ptr, ptr, i64, ptr, ptr,
                                         ptr, i64, ptr, i32]
    lib.kvpark_decode_layers.restype = i32
    return lib


def is_available() -> bool:
    try:
        load_kernels()
        return True
    except KernelUnavailable:
        return False


def _check_rows(x: torch.Tensor) -> None:
    assert x.dtype == torch.float32 and x.dim() >= 2 and x.stride(-1) == 1, (
        "float32 rows with dense features")


def _threads(num_threads: int | None) -> int:
    """The row ops' threads: the kernel threads (`--kernel-threads`) unless told; rows are
    split between them, each row computed the same way by any of them."""
    return worker_pool.get_num_threads() if num_threads is None else num_threads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, isa: Isa | None = None,
             num_threads: int | None = None) -> torch.Tensor:
    """x [rows, n] -> x / sqrt(mean(x^2) + eps) * weight (float32, a fixed order per row)."""
    _check_rows(x)
    rows, n = x.shape
    y = torch.empty(rows, n)
    load_kernels(isa).kvpark_rms_norm(x.data_ptr(), x.stride(0), rows, n, weight.data_ptr(),
                                      eps, y.data_ptr(), y.stride(0), _threads(num_threads))
    return y


def rms_norm_tiles(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   num_threads: int | None = None) -> amx_gemm.ATiles:
    """`rms_norm`'s rows (the same bits) as the A tiles of an AMX GEMM that reads them next:
    no float32 rows written for the GEMM to read and convert."""
    _check_rows(x)
    rows, n = x.shape
    tiles = amx_gemm.ATiles.empty(rows, n)
    done = load_kernels().kvpark_rms_norm_tiles(
        x.data_ptr(), x.stride(0), rows, n, weight.data_ptr(), eps, tiles.data.data_ptr(),
        int(amx_gemm.usable()), _threads(num_threads))
    if done != 0:
        raise MemoryError("rms_norm_tiles: out of memory")
    return tiles


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
         isa: Isa | None = None, num_threads: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE of x [rows, heads, D] (a copy); cos, signed_sin [rows, D] as
    `rope_cos_sin` gives them (its [rows, 1, D] works too)."""
    return rope_(x.contiguous().clone(), cos, signed_sin, isa, num_threads)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
          isa: Isa | None = None, num_threads: int | None = None) -> torch.Tensor:
    """`rope` in place on x [rows, heads, D]: heads dense within a row (a view of a qkv row's q
    and k heads will do), any row stride."""
    rows, heads, dim = x.shape
    assert x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == dim, "dense heads"
    assert cos.stride(-1) == 1 and cos.stride() == signed_sin.stride(), "dense cos/sin rows"
    assert cos.shape[-1] == dim and cos.shape[0] >= rows
    load_kernels(isa).kvpark_rope(x.data_ptr(), x.stride(0), rows, heads, dim, cos.data_ptr(),
                                  signed_sin.data_ptr(), cos.stride(0), _threads(num_threads))
    return x


def silu_mul(gate_up: torch.Tensor, isa: Isa | None = None,
             num_threads: int | None = None) -> torch.Tensor:
    """gate_up [rows, 2n] -> silu(gate) * up [rows, n]."""
    _check_rows(gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(rows, n)
    load_kernels(isa).kvpark_silu_mul(gate_up.data_ptr(), gate_up.stride(0), rows, n,
                                      y.data_ptr(), y.stride(0), _threads(num_threads))
    return y


_local = threading.local()


def get_scratch(num_floats: int) -> torch.Tensor:
    """Per-thread scratch (no allocation, no aten op per call once it is big enough)."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or buffer.numel() < num_floats:
        buffer = _local.scratch = torch.empty(max(1 << 16, num_floats))
    return buffer


def _qweight(weight: QuantizedWeight) -> _QWeight:
    mins = weight.mins.data_ptr() if weight.mins is not None else None
    return _QWeight(weight.kernel_kind, weight.out_features, weight.in_features,
                    weight.scale.data_ptr(), mins, weight.quants.data_ptr())


class FusedLayer:
    """One decoder layer's weights as the C ops read them (a struct of pointers, built once).

    Holds the tensors it points into, so they live as long as it does."""

    def __init__(self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 qkv: QuantizedWeight, o: QuantizedWeight, gate_up: QuantizedWeight,
                 down: QuantizedWeight, isa: Isa | None = None) -> None:
        norms = (input_norm, post_norm)
        assert all(n.dtype == torch.float32 and n.is_contiguous() for n in norms), "norms"
        self._keep = (*norms, qkv, o, gate_up, down)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.hidden = hidden
        self.qkv_features = (num_heads + 2 * num_kv_heads) * head_dim
        self._layer = _Layer(hidden, num_heads, num_kv_heads, head_dim,
                             gate_up.out_features // 2, eps, input_norm.data_ptr(),
                             post_norm.data_ptr(), _qweight(qkv), _qweight(o),
                             _qweight(gate_up), _qweight(down))
        self._ref = ctypes.addressof(self._layer)
        self._lib = load_kernels(isa)
        self._scratch_per_row = self._lib.kvpark_layer_scratch_floats(self._ref, 1)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                         num_threads: int | None = None) -> torch.Tensor:
        """x [rows, hidden] -> [rows, heads + 2 kv heads, D]: q, k (RoPE'd), v heads.
        cos, signed_sin: [rows, D] or [rows, 1, D] with dense D."""
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.stride(-1) == 1, "float32 rows"
        assert cos.stride(-1) == 1 and cos.stride() == signed_sin.stride(), "dense cos/sin rows"
        qkv = torch.empty(rows, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        scratch = get_scratch(rows * self._scratch_per_row)
        status = self._lib.kvpark_layer_pre(
            self._ref, x.data_ptr(), x.stride(0), rows, cos.data_ptr(), signed_sin.data_ptr(),
            cos.stride(0), qkv.data_ptr(), self.qkv_features, scratch.data_ptr(),
            scratch.numel(), num_threads or worker_pool.get_num_threads())
        if status != 0:
            raise RuntimeError(f"layer pre-attention kernel failed (status {status})")
        return qkv

    def mlp_residual(self, x: torch.Tensor, attn: torch.Tensor,
                     num_threads: int | None = None) -> torch.Tensor:
        """x [rows, hidden] += attn W_o^T, then += the MLP of its norm; in place, returns x.
        attn: [rows, heads, D] or [rows, heads * D] with dense rows."""
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.stride(-1) == 1, "float32 rows"
        assert attn.shape[0] == rows and (attn.is_contiguous()
                                          or (attn.dim() == 2 and attn.stride(-1) == 1)), "attn"
        scratch = get_scratch(rows * self._scratch_per_row)
        status = self._lib.kvpark_layer_post(
            self._ref, x.data_ptr(), x.stride(0), rows, attn.data_ptr(), attn.stride(0),
            scratch.data_ptr(), scratch.numel(), num_threads or worker_pool.get_num_threads())
        if status != 0:
            raise RuntimeError(f"layer post-attention kernel failed (status {status})")
        return x


class AttentionPlan(ctypes.Structure):  # AttentionPlan in csrc/entry_points.h
    """A step's attention as the C backend planned it (`CpuPagedAttention.c_plan`); holds the
    tensors it points into."""

    _fields_ = [("num_seqs", ctypes.c_int32), ("page_size", ctypes.c_int32),
                ("scale", ctypes.c_float), ("qo_indptr", ptr), ("kv_lens", ptr),
                ("kv_indptr", ptr), ("kv_indices", ptr), ("rows_k", ptr), ("rows_v", ptr),
                ("kv_bf16", ctypes.c_int32)]


class FusedStack:
    """Every layer of a model as one C call for a step whose rows all read blocks
    (`kvpark_decode_layers`): the calls the Python layer loop makes, in its order, on its
    buffers (so the same bits), without the Python between them: a batch-1 decode step of a
    small model paid a share of its time there (benchmarks/README.md)."""

    def __init__(self, layers: list[FusedLayer]) -> None:
        first = layers[0]
        self._layers = layers  # the structs the pointer array points to
        self._refs = (ctypes.c_void_p * len(layers))(*(layer._ref for layer in layers))
        self.num_layers = len(layers)
        self.q_features = first.num_heads * first.head_dim
        self.qkv_features = first.qkv_features
        self._scratch_per_row = max(layer._scratch_per_row for layer in layers)
        self._lib = first._lib

    def decode(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               caches: list[torch.Tensor], plan: AttentionPlan,
               num_threads: int | None = None) -> torch.Tensor:
        """x [rows, hidden] through every layer, in place (returned); `caches` one per layer
        (float32 or bf16 as `plan` says, contiguous), appended to as the loop appends."""
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.stride(-1) == 1, "float32 rows"
        assert cos.stride(-1) == 1 and cos.stride() == signed_sin.stride(), "dense cos/sin rows"
        assert len(caches) >= self.num_layers
        cache_ptrs = (ctypes.c_void_p * self.num_layers)(
            *(cache.data_ptr() for cache in caches[:self.num_layers]))
        scratch = get_scratch(rows * (self._scratch_per_row + self.qkv_features
                                      + self.q_features))
        qkv = scratch[rows * self._scratch_per_row:]
        attn = qkv[rows * self.qkv_features:]
        status = self._lib.kvpark_decode_layers(
            self._refs, cache_ptrs, self.num_layers, x.data_ptr(), x.stride(0), rows,
            cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), qkv.data_ptr(),
            attn.data_ptr(), scratch.data_ptr(), rows * self._scratch_per_row,
            ctypes.addressof(plan), num_threads or worker_pool.get_num_threads())
        if status != 0:
            raise RuntimeError(f"decode layers kernel failed (status {status})")
        return x
