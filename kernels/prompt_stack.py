"""Every layer of a prompt step on AMX tiles in one C call (`csrc/prompt_layers.c`).

A prompt step of SmolLM2-135M on a 2-core AMX CPU made about ten kernel calls a layer, each
behind a Python wrapper that checks its arguments and allocates its output: a few percent of
the step with the other core waiting. `PromptStack.run` makes the same calls, in the same
order, with the same arguments, from C (so the same bits), on buffers made once a step.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from . import amx_gemm, worker_pool
from .cbuild import load_library
from .layer_ops import AttentionPlan

i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p


class _PromptLayer(ctypes.Structure):  # PromptLayer in csrc/prompt_layers.c
    _fields_ = [("hidden", ctypes.c_int32), ("num_heads", ctypes.c_int32),
                ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("intermediate", ctypes.c_int32), ("eps", ctypes.c_float),
                ("input_norm", ptr), ("post_norm", ptr),
                ("qkv", ptr), ("o", ptr), ("gate_up", ptr), ("down", ptr)]


class PromptPlan(ctypes.Structure):  # PromptPlan in csrc/prompt_layers.c
    """A prompt-only step as the C attention backend planned it
    (`CpuPagedAttention.c_prompt_plan`): its attention plan, each sequence's prompt rows and the
    step's tokens; it points into that plan's tensors."""

    _fields_ = [("attention", AttentionPlan), ("prompt_rows", ptr),
                ("num_tokens", ctypes.c_int32)]


@functools.cache
def _library() -> ctypes.CDLL:
    lib = load_library()
    lib.kvpark_prompt_layers.argtypes = [ptr, ptr, i32, ptr, ptr, i32, ptr, ptr, i64, ptr, ptr,
                                         ptr, ptr, i32, ptr, i32]
    lib.kvpark_prompt_layers.restype = i32
    return lib


@dataclass(frozen=True)
class PromptLayerWeights:
    """One layer's norms and AMX-packed linears, as `DecoderLayer` holds them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    input_norm: torch.Tensor  # float32 [hidden]
    post_norm: torch.Tensor
    qkv: amx_gemm.PackedBf16  # [q; k; v]
    o: amx_gemm.PackedBf16
    gate_up: amx_gemm.PackedBf16  # [gate; up], halves of whole 16-output blocks
    down: amx_gemm.PackedBf16


class PromptStack:
    """The layers of a model whose prompt rows take the AMX path end to end."""

    def __init__(self, layers: list[PromptLayerWeights]) -> None:
        self._weights = layers  # what the structs point into
        self._structs = [_PromptLayer(
            w.o.out_features, w.num_heads, w.num_kv_heads, w.head_dim,
            w.down.in_features, w.eps, w.input_norm.data_ptr(), w.post_norm.data_ptr(),
            w.qkv.data.data_ptr(), w.o.data.data_ptr(), w.gate_up.data.data_ptr(),
            w.down.data.data_ptr()) for w in layers]
        self._refs = (ctypes.c_void_p * len(layers))(
            *(ctypes.addressof(s) for s in self._structs))
        first = layers[0]
        self.num_layers = len(layers)
        self.hidden = first.o.out_features
        self.q_features = first.o.in_features
        self.qkv_features = first.qkv.out_features
        self.intermediate = first.down.in_features

    def run(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            caches: list[torch.Tensor], plan: PromptPlan) -> torch.Tensor:
        """x [rows, hidden] float32 through every layer, in place (returned); cos and signed_sin
        [rows, head_dim] rows as `layer_ops.rope_` takes them; `caches` one per layer, appended
        to as the layer loop appends."""
        rows = x.shape[0]
        assert x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.hidden
        assert cos.stride(-1) == 1 and cos.stride() == signed_sin.stride(), "dense cos/sin rows"
        caches = caches[:self.num_layers]
        cache_ptrs = (ctypes.c_void_p * self.num_layers)(*(c.data_ptr() for c in caches))
        spare = torch.empty_like(x)
        h_tiles = amx_gemm.ATiles.empty(rows, self.hidden)
        qkv = torch.empty(rows, self.qkv_features)
        attn_tiles = amx_gemm.ATiles.empty(rows, self.q_features)
        # the attention writes the step's tokens' rows only: the rest of their tiles stay zero
        attn_tiles.data[attn_tiles.row_tile_start(plan.num_tokens // amx_gemm.TILE_ROWS):].zero_()
        mid_tiles = amx_gemm.ATiles.empty(rows, self.intermediate)
        status = _library().kvpark_prompt_layers(
            self._refs, cache_ptrs, self.num_layers, x.data_ptr(), spare.data_ptr(), rows,
            cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), h_tiles.data.data_ptr(),
            qkv.data_ptr(), attn_tiles.data.data_ptr(), mid_tiles.data.data_ptr(),
            int(amx_gemm.usable()), ctypes.addressof(plan), worker_pool.get_num_threads())
        if status != 0:
            raise RuntimeError(f"prompt layers kernel failed (status {status})")
        return x
