"""bf16 GEMMs on AMX tiles for prompt rows (issue 41, first step: the kernel, not yet wired in).

`csrc/amx_gemm.c` cuts the rows into fixed tiles of 16 (the last one padded) and runs every tile
through the same tile instructions in the same order, so a row's bits never depend on the rows
beside it; threads split the outputs. `pack` puts a weight into the B tiles' layout once.

`usable()` says whether this CPU and OS run AMX (CPUID, then the kernel's permission for tile
data, asked once). Elsewhere `gemm(..., emulate=True)` runs the same packing, tiling and order
in scalar code, so the layout and the invariance are tested on every CPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from . import worker_pool
from .cbuild import KernelUnavailable, load_library
from .cpu_features import MAX_ISA_ENV, detect

log = logging.getLogger(__name__)

TILE_ROWS = 16
TILE_K = 32


@functools.cache
def _library():
    lib = load_library()
    i32, i64, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
    lib.kvpark_amx_gemm_bf16.argtypes = [ptr, i32, i32, ptr, i32, ptr, i32, i32]
    lib.kvpark_amx_gemm_bf16.restype = i32
    lib.kvpark_amx_gemm_bf16_silu.argtypes = [ptr, i32, i32, ptr, i32, ptr, i32, i32]
    lib.kvpark_amx_gemm_bf16_silu.restype = i32
    lib.kvpark_amx_gemm_bf16_add.argtypes = [ptr, i32, i32, ptr, i32, ptr, ptr, i32, i32]
    lib.kvpark_amx_gemm_bf16_add.restype = i32
    lib.kvpark_amx_pack_bf16.argtypes = [ptr, i32, i32, ptr]
    lib.kvpark_amx_packed_elems.argtypes = [i32, i32]
    lib.kvpark_amx_packed_elems.restype = i64
    return lib


@functools.cache
def usable() -> bool:
    """AMX tiles run here: the library has the AMX path, the CPU the bits, the OS allows it.
    Says once why not."""
    if not detect().has_amx_bf16:
        log.info("AMX GEMM: off (no amx_tile/amx_bf16 in /proc/cpuinfo, or %s caps them)",
                 MAX_ISA_ENV)
        return False
    try:
        lib = _library()
    except KernelUnavailable as exc:
        log.info("AMX GEMM: off (no C kernels: %s)", exc)
        return False
    if not lib.kvpark_amx_built():
        log.info("AMX GEMM: off (the compiler has no AMX intrinsics)")
        return False
    if not lib.kvpark_amx_usable():
        log.info("AMX GEMM: off (no amx_tile/amx_bf16 here, or the OS refused tile data)")
        return False
    return True


@dataclass(frozen=True)
class PackedBf16:
    """W [out, in] as bf16 B tiles: blocks of 16 outputs x 32 inputs, zero-padded."""

    data: torch.Tensor  # int16, kvpark_amx_packed_elems(out, in) values
    out_features: int
    in_features: int


def pack(weight: torch.Tensor) -> PackedBf16:
    """W [out, in] float32 -> its B tiles (bf16, rounded to nearest even)."""
    w = weight.detach().to(torch.float32).contiguous()
    n, k = w.shape
    data = torch.empty(_library().kvpark_amx_packed_elems(n, k), dtype=torch.int16)
    _library().kvpark_amx_pack_bf16(w.data_ptr(), n, k, data.data_ptr())
    return PackedBf16(data, n, k)


def gemm(x: torch.Tensor, weight: PackedBf16, emulate: bool = False,
         num_threads: int | None = None) -> torch.Tensor:
    """x [rows, in] float32 (rounded to bf16) times W^T: [rows, out] float32."""
    return _run(_library().kvpark_amx_gemm_bf16, x, weight, weight.out_features, emulate,
                num_threads)


def gemm_add(x: torch.Tensor, weight: PackedBf16, residual: torch.Tensor,
             emulate: bool = False, num_threads: int | None = None) -> torch.Tensor:
    """residual + x W^T, [rows, out] float32: the bits of `residual + gemm(x, W)` without a
    pass of its own over the rows."""
    residual = residual.to(torch.float32).contiguous()
    assert residual.shape == (x.shape[0], weight.out_features)

    def add(x_ptr, m, k, w_ptr, n, y_ptr, threads, emulated):
        return _library().kvpark_amx_gemm_bf16_add(x_ptr, m, k, w_ptr, n, residual.data_ptr(),
                                                   y_ptr, threads, emulated)
    return _run(add, x, weight, weight.out_features, emulate, num_threads)


def fuses_silu(weight: PackedBf16) -> bool:
    """`gemm_silu` takes this weight: its outputs split into halves of whole 16-output blocks."""
    return weight.out_features % (2 * TILE_ROWS) == 0


def gemm_silu(x: torch.Tensor, gate_up: PackedBf16, emulate: bool = False,
              num_threads: int | None = None) -> torch.Tensor:
    """silu(g) * u for [g, u] = x [gate; up]^T, [rows, out / 2] float32: the bits of `gemm`
    then `layer_ops.silu_mul`, without writing the GEMM's [rows, out]."""
    assert fuses_silu(gate_up), "the halves of the outputs must be whole blocks of 16"
    return _run(_library().kvpark_amx_gemm_bf16_silu, x, gate_up, gate_up.out_features // 2,
                emulate, num_threads)


def _run(fn, x: torch.Tensor, weight: PackedBf16, out_features: int, emulate: bool,
         num_threads: int | None) -> torch.Tensor:
    x = x.to(torch.float32).contiguous()
    assert x.dim() == 2 and x.shape[1] == weight.in_features
    if not emulate and not usable():  # the cap (KVPARK_MAX_CPU_ISA) too, not only the CPU
        raise KernelUnavailable("AMX is not usable here")
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    threads = worker_pool.get_num_threads() if num_threads is None else num_threads
    done = fn(x.data_ptr(), x.shape[0], x.shape[1], weight.data.data_ptr(),
              weight.out_features, y.data_ptr(), threads, int(emulate))
    if done != 0:
        raise KernelUnavailable("AMX is not usable here" if done == -1 else "out of memory")
    return y
