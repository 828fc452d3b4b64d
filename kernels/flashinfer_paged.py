"""Paged attention over FlashInfer 0.7.4: the CUDA backend.

One step: `plan(layout)` uploads the step's index arrays once and plans one FlashInfer wrapper
(batch decode when every row feeds one token, batch prefill otherwise); then per layer
`append_kv` writes the new K/V with `flashinfer.append_paged_kv_cache` and `attend` runs the
planned wrapper. The pool's per-layer cache `[num_pages, 2, page_size, Hkv, D]` is FlashInfer's
NHD layout as is.

CUDA graphs: `prepare_graph(batch_size, max_pages)` makes a `use_cuda_graph=True` decode wrapper
whose index buffers have fixed addresses, and `plan_graph(layout)` re-plans it into those buffers
outside the graph before each replay (a captured kernel keeps reading the same addresses).

`flashinfer` is imported only when a backend is built, so importing `kvpark.kernels` never
needs it. Argument names follow FlashInfer 0.7.4's Python sources (decode.py, prefill.py,
page.py); tests/fake_flashinfer.py mirrors them and a test binds every call against them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from .attention import AttentionBackend, PlanArrays, StepLayout, get_plan_arrays

KV_LAYOUT = "NHD"
# The bundled AOT kernels are FA2 (FA3 only for fp16/128), and "auto" picks FA3 for long
# prefills on sm90 or cuDNN on sm100: pin FA2 so no step ever needs a JIT build.
WRAPPER_BACKEND = "fa2"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
# FlashInfer's advice: the tensor-core (prefill-kernel) decode wins from a GQA group of 4 up.
TENSOR_CORE_MIN_GROUP = 4


class FlashInferUnavailable(ImportError):
    """FlashInfer cannot run here: no CUDA device, or the package is missing.

    An ImportError, so `--attention-backend auto` can catch it and fall back to torch.
    """


def load_flashinfer(device: torch.device | str) -> ModuleType:
    device = torch.device(device)
    if device.type != "cuda":
        raise FlashInferUnavailable(
            f"the FlashInfer attention backend needs a CUDA device, got {device}; "
            "use --attention-backend torch (or auto) on the CPU"
        )
    if not torch.cuda.is_available():
        raise FlashInferUnavailable(
            f"the FlashInfer attention backend needs CUDA, but torch {torch.__version__} "
            "sees no CUDA device"
        )
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise FlashInferUnavailable(
            f"the FlashInfer attention backend needs the flashinfer package ({exc}); "
            "install flashinfer-python 0.7.4 or use --attention-backend torch"
        ) from exc


def is_flashinfer_available(device: torch.device | str) -> bool:
    try:
        load_flashinfer(device)
    except FlashInferUnavailable:
        return False
    return True


@dataclass(frozen=True)
class AttentionShape:
    """What FlashInfer plans for: heads, head size, page size and dtypes."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype

    @property
    def gqa_group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def use_tensor_cores(self) -> bool:
        return self.gqa_group >= TENSOR_CORE_MIN_GROUP

    @classmethod
    def from_tensors(cls, q: torch.Tensor, kv_cache: torch.Tensor) -> AttentionShape:
        # q: [T, Hq, D]; kv_cache: [pages, 2, page_size, Hkv, D]
        return cls(num_qo_heads=q.shape[1], num_kv_heads=kv_cache.shape[3],
                   head_dim=q.shape[2], page_size=kv_cache.shape[2], q_dtype=q.dtype,
                   kv_dtype=kv_cache.dtype)


@dataclass(frozen=True)
class StepTensors:
    """Device index arrays that `append_kv` reads during one step."""

    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [>= kv_indptr[-1]] int32
    kv_last_page_len: torch.Tensor  # [B] int32
    batch_indices: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32


@dataclass(frozen=True)
class GraphBuffers:
    """A graph bucket's wrapper and the fixed-address buffers its captured kernels read."""

    wrapper: Any
    kv_indptr: torch.Tensor  # [bucket + 1]
    kv_indices: torch.Tensor  # [max_pages]
    kv_last_page_len: torch.Tensor  # [bucket]
    batch_indices: torch.Tensor  # [bucket]
    positions: torch.Tensor  # [bucket]


def upload_plan_arrays(arrays: PlanArrays, device: torch.device) -> PlanArrays:
    """One host-to-device copy for the whole step instead of six."""
    parts = [arrays.qo_indptr, arrays.kv_indptr, arrays.kv_indices, arrays.kv_last_page_len,
             arrays.batch_indices, arrays.positions]
    flat = torch.cat(parts).to(device, non_blocking=True)
    views = flat.split([p.numel() for p in parts])
    return PlanArrays(*views)


class FlashInferPagedAttention(AttentionBackend):
    name = "flashinfer"
    can_capture_graphs = True

    def __init__(self, device: torch.device | str, shape: AttentionShape | None = None,
                 workspace_bytes: int = WORKSPACE_BYTES) -> None:
        self.device = torch.device(device)
        self._fi = load_flashinfer(self.device)
        # one float workspace for every wrapper: they run one after another on one stream
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.shape: AttentionShape | None = None
        self._prefill: Any = None
        self._decode: Any = None
        self._graphs: dict[int, GraphBuffers] = {}
        self._step: StepTensors | None = None
        self._wrapper: Any = None  # the wrapper planned for this step; `attend` runs it
        self._pending: tuple[bool, PlanArrays, torch.Tensor] | None = None
        if shape is not None:
            self.configure(shape)

    # ---- set-up ------------------------------------------------------------------------------
    def configure(self, shape: AttentionShape) -> None:
        """Fix the shape and build the eager wrappers (once; tensor cores depend on the group)."""
        if self.shape is not None:
            assert shape == self.shape, f"backend planned for {self.shape}, asked for {shape}"
            return
        self.shape = shape
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, backend=WRAPPER_BACKEND
        )
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, use_tensor_cores=shape.use_tensor_cores,
            backend=WRAPPER_BACKEND,
        )

    def prepare_graph(self, batch_size: int, max_pages: int) -> None:
        """A CUDA-graph decode wrapper for exactly `batch_size` rows (one per bucket)."""
        assert self.shape is not None, "configure() the shape before preparing graphs"
        if batch_size in self._graphs:
            return

        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        kv_indptr, kv_indices, last = buffer(batch_size + 1), buffer(max_pages), buffer(batch_size)
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, KV_LAYOUT, use_cuda_graph=True,
            use_tensor_cores=self.shape.use_tensor_cores,
            paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
            paged_kv_last_page_len_buffer=last, backend=WRAPPER_BACKEND,
        )
        self._graphs[batch_size] = GraphBuffers(wrapper, kv_indptr, kv_indices, last,
                                                buffer(batch_size), buffer(batch_size))

    @property
    def graph_batch_sizes(self) -> list[int]:
        return sorted(self._graphs)

    # ---- one step ----------------------------------------------------------------------------
    def plan(self, layout: StepLayout) -> None:
        arrays = get_plan_arrays(layout)  # host copies: FlashInfer's planner reads them there
        on_device = upload_plan_arrays(arrays, self.device)
        self._step = StepTensors(on_device.kv_indptr, on_device.kv_indices,
                                 on_device.kv_last_page_len, on_device.batch_indices,
                                 on_device.positions)
        self._wrapper = None
        self._pending = (layout.is_decode_only, arrays, on_device.kv_indices)
        if self.shape is not None:
            self._plan_pending()

    def plan_graph(self, layout: StepLayout) -> None:
        """Re-plan the bucket's graph wrapper for a (padded) decode step, outside the graph."""
        assert layout.is_decode_only, "graphs capture decode steps only"
        assert layout.num_seqs in self._graphs, (
            f"no graph bucket of {layout.num_seqs} rows (have {self.graph_batch_sizes})"
        )
        buffers = self._graphs[layout.num_seqs]
        arrays = get_plan_arrays(layout)
        on_device = upload_plan_arrays(arrays, self.device)
        # plan() copies indptr / indices / last_page_len into the wrapper's fixed buffers
        self._plan_decode(buffers.wrapper, arrays, on_device.kv_indices)
        buffers.batch_indices.copy_(on_device.batch_indices, non_blocking=True)
        buffers.positions.copy_(on_device.positions, non_blocking=True)
        self._step = StepTensors(buffers.kv_indptr, buffers.kv_indices,
                                 buffers.kv_last_page_len, buffers.batch_indices,
                                 buffers.positions)
        self._wrapper = buffers.wrapper
        self._pending = None

    def append_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        step = self._require_step()
        # k, v: [T, Hkv, D] (v may be a strided view of the fused qkv; FlashInfer takes strides)
        self._fi.append_paged_kv_cache(
            k.to(kv_cache.dtype), v.to(kv_cache.dtype), step.batch_indices, step.positions,
            kv_cache, step.kv_indices, step.kv_indptr, step.kv_last_page_len,
            kv_layout=KV_LAYOUT,
        )

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        self._require_step()
        if self._pending is not None:  # the shape was unknown at plan(): the first layer tells
            self.configure(AttentionShape.from_tensors(q, kv_cache))
            self._plan_pending()
        return self._wrapper.run(q, kv_cache)

    # ---- helpers -----------------------------------------------------------------------------
    def _require_step(self) -> StepTensors:
        assert self._step is not None, "plan() the step before append_kv/attend"
        return self._step

    def _plan_pending(self) -> None:
        assert self._pending is not None
        decode, arrays, kv_indices = self._pending
        self._pending = None
        self._wrapper = self._decode if decode else self._prefill
        if decode:
            self._plan_decode(self._decode, arrays, kv_indices)
        else:
            self._plan_prefill(arrays, kv_indices)

    def _plan_decode(self, wrapper: Any, arrays: PlanArrays, kv_indices: torch.Tensor) -> None:
        s = self.shape
        assert s is not None
        # indptr / last_page_len stay on the host (the planner reads them there without a
        # device sync); the indices are already on the device, so FlashInfer's copy is a no-op
        wrapper.plan(arrays.kv_indptr, kv_indices, arrays.kv_last_page_len, s.num_qo_heads,
                     s.num_kv_heads, s.head_dim, s.page_size, q_data_type=s.q_dtype,
                     kv_data_type=s.kv_dtype)

    def _plan_prefill(self, arrays: PlanArrays, kv_indices: torch.Tensor) -> None:
        s = self.shape
        assert s is not None
        # causal with q_len < kv_len is aligned bottom-right: a chunk sees its whole prefix
        self._prefill.plan(arrays.qo_indptr, arrays.kv_indptr, kv_indices,
                           arrays.kv_last_page_len, s.num_qo_heads, s.num_kv_heads, s.head_dim,
                           s.page_size, causal=True, q_data_type=s.q_dtype,
                           kv_data_type=s.kv_dtype)
