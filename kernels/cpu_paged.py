"""Paged attention on the CPU that reads K and V in place: a small C kernel (csrc/).

The torch reference gathers every sequence's pages into a contiguous copy before SDPA, once per
layer; at decode that copy costs as much as the attention itself (benchmarks/README.md, "CPU
decode step"). `csrc/paged_attention.c` walks the page table instead. It is compiled on first use
with the system C compiler for this CPU (`-O3 -march=native`, the AVX-512 or AVX2 build as
`cpu_features` finds; well under a second) into a cache folder and loaded with ctypes: no torch
headers, no build step at install time. Where no compiler works, `load_kernel` raises
`KernelUnavailable` and the server keeps the torch backend.

Every query row is computed by the same arithmetic whatever else the step holds (see the C
file), so greedy output stays independent of batch neighbours and of prompt chunking, and a
recompute replay reproduces the decode rows' bits. Float32 rows; the pool float32 or bf16
(`--cache-type-k/v bf16`: half the bytes a decode step streams; each value read exactly as the
float32 it is the top half of, float32 products; the dots add them in lanes of their own, see
the C file).

Where the prompt rows' linears run on AMX, the rows a step's layout marks as prompt rows take
`csrc/amx_attention.c` instead (bf16 tile products, float32 sums; the same per-row guarantee),
the others this kernel: each row the kernel its position gives it, in a replay too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import amx_gemm, worker_pool
from .attention import StepLayout, get_plan_arrays
from .cbuild import CSRC, KernelUnavailable, load_library
from .cpu_features import Isa
from .layer_ops import AttentionPlan
from .prompt_stack import PromptPlan
from .torch_paged import TorchPagedAttention

log = logging.getLogger(__name__)

SOURCE = CSRC / "paged_attention.c"
KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches the C kernels read


@functools.cache
def load_kernel(isa: Isa | None = None) -> ctypes.CDLL:
    """The kernel built for `isa` (default: the best this CPU has)."""
    lib = load_library(isa)
    fn = lib.kvpark_paged_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i32, ptr, i32, ptr, ptr, ptr, ptr, i32, i32, i32, i32,
                   ctypes.c_float, i32]
    fn.restype = i32
    prompt = lib.kvpark_amx_prompt_attention
    prompt.argtypes = [ptr, i64, i64, ptr, i32, ptr, i32, ptr, ptr, ptr, ptr, ptr, i32, i32, i32,
                       i32, ctypes.c_float, i32]
    prompt.restype = i32
    tiles = lib.kvpark_amx_prompt_attention_tiles  # the same with the output as A tiles
    tiles.argtypes = prompt.argtypes
    tiles.restype = i32
    append = lib.kvpark_append_kv
    append.argtypes = [ptr, i32, ptr, i64, ptr, i64, ptr, ptr, i32, i32]
    append.restype = None
    return lib


def is_available() -> bool:
    try:
        load_kernel()
        return True
    except KernelUnavailable as exc:
        log.debug("C paged attention unavailable: %s", exc)
        return False


def amx_prompt_rows_fit(head_dim: int, group: int = 1) -> bool:
    """csrc/amx_attention.c takes head dims in whole tile rows (32 bf16), up to 256, and up to
    16 query heads a KV head."""
    return head_dim % 32 == 0 and head_dim <= 256 and 1 <= group <= 16


def why_no_amx_prompt_rows(head_dim: int, group: int = 1) -> str | None:
    """Why prompt rows' attention cannot run on AMX tiles here (None: it can)."""
    if not amx_prompt_rows_fit(head_dim, group):
        return (f"AMX tiles take head dims in multiples of 32 up to 256 and up to 16 query heads "
                f"a KV head, not {head_dim} and {group}")
    return why_no_amx_kernel()


def why_no_amx_kernel(isa: Isa | None = None) -> str | None:
    """Why csrc/amx_attention.c cannot run here (None: it can)."""
    if not amx_gemm.usable():
        return "AMX does not run here"
    try:
        built = load_kernel(isa).kvpark_amx_attention_built()
    except KernelUnavailable as exc:
        return str(exc)
    return None if built else "the compiler has no AMX intrinsics"


@dataclass(frozen=True)
class GeneratedRows:
    """A step's rows past the prompt, as a plan of their own for paged_attention.c: the last
    rows of their sequences, at the same KV lengths (int32 arrays as the kernel takes them)."""

    index: torch.Tensor  # the rows' places in the step (int64)
    qo_indptr: torch.Tensor
    kv_lens: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor

    @classmethod
    def of(cls, layout: StepLayout) -> GeneratedRows | None:
        index: list[int] = []
        qo_indptr, kv_lens, kv_indptr, kv_indices = [0], [], [0], []
        row = 0
        for table, kv_len, q_len, prompt in zip(layout.page_tables, layout.kv_lens,
                                                layout.q_lens, layout.prompt_rows):
            if q_len > prompt:
                pages = -(-kv_len // layout.page_size)
                index.extend(range(row + prompt, row + q_len))
                qo_indptr.append(qo_indptr[-1] + q_len - prompt)
                kv_lens.append(kv_len)
                kv_indptr.append(kv_indptr[-1] + pages)
                kv_indices.extend(table[:pages])
            row += q_len
        if not index:
            return None

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        return cls(torch.tensor(index), int32(qo_indptr), int32(kv_lens), int32(kv_indptr),
                   int32(kv_indices))


class CpuPagedAttention(TorchPagedAttention):
    """The torch reference's planning and KV append; attention by the C kernel.

    With `amx_prompt_rows` (where the prompt rows' linears run on AMX: `--amx`), the rows a
    layout marks as prompt rows take csrc/amx_attention.c (bf16 tile products, float32 sums)
    and the rest paged_attention.c, each row the kernel its position gives it."""

    name = "cpu"

    def __init__(self, device: torch.device | str = "cpu", num_threads: int | None = None,
                 isa: Isa | None = None, amx_prompt_rows: bool = False) -> None:
        super().__init__(device)
        self.amx_prompt_rows = amx_prompt_rows
        if amx_prompt_rows:
            why_not = why_no_amx_kernel(isa)
            if why_not is not None:
                raise KernelUnavailable(f"AMX prompt-row attention: {why_not}")
            self.name = "cpu+amx"  # in the numerics fingerprint: prompt rows' bits differ
        self._prompt_kernel = load_kernel(isa).kvpark_amx_prompt_attention
        self._prompt_tiles_kernel = load_kernel(isa).kvpark_amx_prompt_attention_tiles
        self._prompt_rows: torch.Tensor | None = None  # this step's, where AMX takes them
        self._generated: GeneratedRows | None = None
        # the worker pool's threads (kernels/worker_pool.py) split the (sequence, row tile)
        # items, or a long decode row's chunks; None: the process-wide `--kernel-threads`
        self.num_threads = num_threads
        assert self.device.type == "cpu", "the C kernel runs on the CPU"
        self._kernel = load_kernel(isa).kvpark_paged_attention
        self._append = load_kernel(isa).kvpark_append_kv
        self._arrays = None
        self._layout: StepLayout | None = None
        self._views = None

    def plan(self, layout: StepLayout) -> None:
        self._arrays = get_plan_arrays(layout)
        self._kv_lens = torch.tensor(layout.kv_lens, dtype=torch.int32)
        self._page_size = layout.page_size
        self._plan_append(self._arrays, layout.page_size)  # the reference's KV append
        self._layout, self._views = layout, None  # the reference's views: only if it attends
        self._prompt_rows = self._generated = None
        if self.amx_prompt_rows and layout.prompt_rows is not None and any(layout.prompt_rows):
            self._prompt_rows = torch.tensor(layout.prompt_rows, dtype=torch.int32)
            self._generated = GeneratedRows.of(layout)

    def c_plan(self, head_dim: int, kv_dtype: torch.dtype = torch.float32) -> AttentionPlan:
        """This step's plan as `layer_ops.FusedStack` hands it to C: what `append_kv` and
        `attend` pass their kernels, scaled for `head_dim` as `attend` scales, for caches of
        `kv_dtype`. It points into this plan's tensors: valid until the next `plan`."""
        assert kv_dtype in KV_DTYPES, f"the C kernels read float32 or bf16 caches, not {kv_dtype}"
        a = self._arrays
        return AttentionPlan(
            len(self._kv_lens), self._page_size, head_dim ** -0.5, a.qo_indptr.data_ptr(),
            self._kv_lens.data_ptr(), a.kv_indptr.data_ptr(), a.kv_indices.data_ptr(),
            self._append_rows.data_ptr(), self._append_rows_v.data_ptr(),
            kv_dtype == torch.bfloat16)

    def c_prompt_plan(self, head_dim: int, kv_dtype: torch.dtype) -> PromptPlan | None:
        """This step's plan as `prompt_stack.PromptStack` hands it to C, where every row is a
        prompt row the AMX attention computes (what `append_kv` and `attend_tiles` pass their
        kernels); None for any other step. Valid until the next `plan`."""
        if self._prompt_rows is None or self._generated is not None:
            return None
        return PromptPlan(self.c_plan(head_dim, kv_dtype), self._prompt_rows.data_ptr(),
                          self._append_rows.shape[0])

    def append_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """One C call (a copy or a rounding a row) where k and v are float32 rows of whole
        heads."""
        num_tokens, num_kv_heads, head_dim = k.shape
        if not (k.dtype == v.dtype == torch.float32 and kv_cache.dtype in KV_DTYPES
                and kv_cache.is_contiguous() and self._append_rows.shape[0] == num_tokens
                and k.stride()[1:] == v.stride()[1:] == (head_dim, 1)):
            return super().append_kv(kv_cache, k, v)
        self._append(kv_cache.data_ptr(), kv_cache.dtype == torch.bfloat16, k.data_ptr(),
                     k.stride(0), v.data_ptr(), v.stride(0), self._append_rows.data_ptr(),
                     self._append_rows_v.data_ptr(), num_tokens, num_kv_heads * head_dim)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        if q.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPES:
            if self._views is None:
                self._plan_views(self._layout)
            return super().attend(q, kv_cache)
        # q: [T, Hq, D] (a strided view of the qkv output); kv_cache: [pages, 2, ps, Hkv, D]
        assert q.stride(-1) == 1 and kv_cache.is_contiguous(), "dense head_dim and cache"
        if self._prompt_rows is None:
            a = self._arrays
            return self.rows_fp32(q, kv_cache, a.qo_indptr, self._kv_lens, a.kv_indptr,
                                  a.kv_indices)
        out = self.prompt_rows_amx(q, kv_cache)
        rest = self._generated
        if rest is not None:
            out.index_copy_(0, rest.index, self.rows_fp32(
                q.index_select(0, rest.index), kv_cache, rest.qo_indptr, rest.kv_lens,
                rest.kv_indptr, rest.kv_indices))
        return out

    def rows_fp32(self, q: torch.Tensor, kv_cache: torch.Tensor, qo_indptr: torch.Tensor,
                  kv_lens: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor) -> torch.Tensor:
        """paged_attention.c over the rows of q that the arrays describe (all of them)."""
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim)
        status = self._kernel(
            q.data_ptr(), q.stride(0), q.stride(1), kv_cache.data_ptr(),
            kv_cache.dtype == torch.bfloat16, out.data_ptr(), len(kv_lens), qo_indptr.data_ptr(),
            kv_lens.data_ptr(), kv_indptr.data_ptr(), kv_indices.data_ptr(), num_heads,
            kv_cache.shape[-2], head_dim, self._page_size, head_dim ** -0.5,
            self.num_threads or worker_pool.get_num_threads())
        if status != 0:
            raise RuntimeError(f"paged attention kernel failed (status {status})")
        return out

    def attend_tiles(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     rows: int) -> amx_gemm.ATiles | None:
        """amx_attention.c straight into the o projection's A tiles, where it computes every
        row of the step (a step of prompt rows only) from float32 q."""
        if (self._prompt_rows is None or self._generated is not None
                or q.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPES):
            return None
        num_tokens, num_heads, head_dim = q.shape
        out = amx_gemm.ATiles.empty(rows, num_heads * head_dim)
        out.data[out.row_tile_start(num_tokens // amx_gemm.TILE_ROWS):].zero_()  # past T
        self._prompt_call(self._prompt_tiles_kernel, q, kv_cache, out.data)
        return out

    def prompt_rows_amx(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """amx_attention.c over this step's prompt rows; the other rows of the result are not
        written."""
        out = torch.empty(q.shape)
        self._prompt_call(self._prompt_kernel, q, kv_cache, out)
        return out

    def _prompt_call(self, kernel: Callable[..., int], q: torch.Tensor,
                     kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """One of amx_attention.c's entries (float32 rows or A tiles into `out`) on this
        step's plan."""
        num_heads, head_dim = q.shape[1:]
        a = self._arrays
        status = kernel(
            q.data_ptr(), q.stride(0), q.stride(1), kv_cache.data_ptr(),
            kv_cache.dtype == torch.bfloat16, out.data_ptr(), len(self._kv_lens),
            a.qo_indptr.data_ptr(), self._prompt_rows.data_ptr(),
            self._kv_lens.data_ptr(), a.kv_indptr.data_ptr(), a.kv_indices.data_ptr(),
            num_heads, kv_cache.shape[-2], head_dim, self._page_size, head_dim ** -0.5,
            self.num_threads or worker_pool.get_num_threads())
        if status != 0:
            raise RuntimeError(f"AMX prompt-row attention failed (status {status})")
