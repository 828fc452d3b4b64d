"""bf16 GEMMs on AMX tiles for prompt rows (`--amx`, the `amx-bf16` linears).

`csrc/amx_gemm.c` cuts the rows into fixed tiles of 16 (the last one padded) and runs every tile
through the same tile instructions in the same order, so a row's bits never depend on the rows
beside it; threads split the outputs. `pack` puts a weight into the B tiles' layout once.
`gemm_add` and `gemm_silu` carry the residual add and SwiGLU in the GEMM's last pass, and the
rows may come as `ATiles` a producer wrote (the GEMM's own bf16 input layout): each the bits
of float32 rows, the GEMM, then the separate op.

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
    return declare(load_library())


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The GEMM's C signatures on a kernels library (this one, or another build's:
    benchmarks/kernel_builds.py)."""
    i32, i64, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
    lib.kvpark_amx_gemm.argtypes = [ptr, ptr, i32, i32, ptr, i32, ptr, ptr, ptr, i32, i32, i32]
    lib.kvpark_amx_gemm.restype = i32
    lib.kvpark_amx_pack_bf16.argtypes = [ptr, i32, i32, ptr]
    lib.kvpark_amx_packed_elems.argtypes = [i32, i32]
    lib.kvpark_amx_packed_elems.restype = i64
    lib.kvpark_amx_a_tiles_elems.argtypes = [i32, i32]
    lib.kvpark_amx_a_tiles_elems.restype = i64
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


@dataclass(frozen=True)
class ATiles:
    """Activations [rows, cols] as the GEMM's bf16 A tiles (csrc/a_tiles.h), written by a
    producer (`layer_ops.rms_norm_tiles`, `gemm_silu(..., tiles=True)`) for one GEMM to read:
    the bits of float32 rows the GEMM would convert, without the float32 rows."""

    data: torch.Tensor  # int16, kvpark_amx_a_tiles_elems(rows, cols) values
    rows: int
    cols: int

    @staticmethod
    def empty(rows: int, cols: int) -> ATiles:
        """Room for the tiles; columns past `cols` in the last block are zero (producers write
        whole rows, or, for SwiGLU, only the 16-column halves that hold values)."""
        elems = _library().kvpark_amx_a_tiles_elems(rows, cols)
        make = torch.empty if cols % TILE_K == 0 else torch.zeros
        return ATiles(make(elems, dtype=torch.int16), rows, cols)

    def row_tile_start(self, tile: int) -> int:
        """Where row tile `tile` begins in `data` (a row tile's blocks lie together)."""
        return tile * TILE_ROWS * -(-self.cols // TILE_K) * TILE_K


Rows = torch.Tensor | ATiles


def gemm(x: Rows, weight: PackedBf16, emulate: bool = False,
         num_threads: int | None = None) -> torch.Tensor:
    """x [rows, in] float32 (rounded to bf16) or its A tiles, times W^T: [rows, out] float32."""
    y = torch.empty(x.shape[0] if isinstance(x, torch.Tensor) else x.rows, weight.out_features)
    _run(x, weight, emulate, num_threads, y=y)
    return y


def gemm_add(x: Rows, weight: PackedBf16, residual: torch.Tensor, emulate: bool = False,
             num_threads: int | None = None) -> torch.Tensor:
    """residual + x W^T, [rows, out] float32: the bits of `residual + gemm(x, W)` without a
    pass of its own over the rows."""
    residual = residual.to(torch.float32).contiguous()
    y = torch.empty_like(residual)
    _run(x, weight, emulate, num_threads, y=y, residual=residual)
    return y


def fuses_silu(weight: PackedBf16) -> bool:
    """`gemm_silu` takes this weight: its outputs split into halves of whole 16-output blocks."""
    return weight.out_features % (2 * TILE_ROWS) == 0


def gemm_silu(x: Rows, gate_up: PackedBf16, emulate: bool = False,
              num_threads: int | None = None, tiles: bool = False) -> torch.Tensor | ATiles:
    """silu(g) * u for [g, u] = x [gate; up]^T, [rows, out / 2] float32 (or, with `tiles`, as
    the next GEMM's A tiles): the bits of `gemm` then `layer_ops.silu_mul`, without writing
    the GEMM's [rows, out]."""
    assert fuses_silu(gate_up), "the halves of the outputs must be whole blocks of 16"
    rows, half = (x.shape[0] if isinstance(x, torch.Tensor) else x.rows), gate_up.out_features // 2
    if tiles:
        out = ATiles.empty(rows, half)
        _run(x, gate_up, emulate, num_threads, y_tiles=out, silu=True)
        return out
    y = torch.empty(rows, half)
    _run(x, gate_up, emulate, num_threads, y=y, silu=True)
    return y


def _run(x: Rows, weight: PackedBf16, emulate: bool, num_threads: int | None, *,
         y: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         y_tiles: ATiles | None = None, silu: bool = False) -> None:
    if isinstance(x, ATiles):
        rows, a_tiles, x_ptr = x.rows, x.data.data_ptr(), None
        assert x.cols == weight.in_features
    else:
        x = x.to(torch.float32).contiguous()
        assert x.dim() == 2 and x.shape[1] == weight.in_features
        rows, a_tiles, x_ptr = x.shape[0], None, x.data_ptr()
    if not emulate and not usable():  # the cap (KVPARK_MAX_CPU_ISA) too, not only the CPU
        raise KernelUnavailable("AMX is not usable here")
    threads = worker_pool.get_num_threads() if num_threads is None else num_threads
    done = _library().kvpark_amx_gemm(
        x_ptr, a_tiles, rows, weight.in_features, weight.data.data_ptr(), weight.out_features,
        None if residual is None else residual.data_ptr(), None if y is None else y.data_ptr(),
        None if y_tiles is None else y_tiles.data.data_ptr(), int(silu), threads, int(emulate))
    if done == -3:
        raise ValueError("SwiGLU: the gate and up halves are not whole blocks of 16 outputs")
    if done != 0:
        raise KernelUnavailable("AMX is not usable here" if done == -1 else "out of memory")
