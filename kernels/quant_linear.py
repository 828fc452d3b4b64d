"""Linears over a GGUF checkpoint's own Q4_1 / Q8_0 blocks, for decode rows on the CPU.

A CPU decode step reads every weight once: 538 MB in float32 for SmolLM2-135M, against ~100 MB
for its Q4_1 blocks (repacked with float32 scales) and the Q8_0 embedding. `csrc/quant_linear.c`
quantises each row of activations to 8 bits per block of 32 (as llama.cpp does) and sums each
block in integers: y = sum_b (dw_b dx_b) isum_b (+ sum_b min_b dx_b sum(qx_b) for Q4_1): the
dequantised weights times the quantised activations.
`tests/reference_quant_linear.py` is the same arithmetic in torch. Rows are independent (a row's
bits never depend on the other rows of a call, nor on the thread count). Prefill rows keep the
float32 oneDNN GEMMs, which are compute-bound there and much faster than this kernel.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import worker_pool
from .cbuild import CSRC, KernelUnavailable, load_library
from .cpu_features import Isa

if TYPE_CHECKING:  # numpy only where a GGUF is read: the GPU machine has none
    import numpy as np

SOURCE = CSRC / "quant_linear.c"
BLOCK = 32
KINDS = {"Q4_1": 0, "Q8_0": 1}
TILE_OUTPUTS = 16  # outputs per tile in the "tiles" layout
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # GGUF: fp16 scale (+ fp16 min), then the quants


@functools.cache
def load_kernel(isa: Isa | None = None):
    """The kernel built for `isa` (default: the best this CPU has)."""
    fn = load_library(isa).kvpark_quant_linear
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i32, ptr, ptr, ptr, i32, i32, ptr, i64, i32, ptr, i64, ptr, i32]
    fn.restype = i32
    return fn


def is_available() -> bool:
    try:
        load_kernel()
        return True
    except KernelUnavailable:
        return False


@dataclass(frozen=True)
class QuantizedWeight:
    """W [out, in] as blocks of 32 inputs: float32 scales (and mins), then the quants."""

    kind: str  # "Q4_1" or "Q8_0"
    scale: torch.Tensor  # [out, in / 32] float32
    mins: torch.Tensor | None  # [out, in / 32] float32 (Q4_1), stored block-major (see below)
    quants: torch.Tensor  # [out, in / 32, 16] uint8 nibbles (Q4_1) or [out, in / 32, 32] int8
    # "rows" as above, for csrc/quant_linear.c; "tiles" for csrc/quant_tiles.c (`tiled`), whose
    # scale and mins are [out tiles, in / 32, 16] and quants one B tile per tile and block
    layout: str = "rows"
    tiled_outputs: int = 0  # "tiles": the real outputs (the last tile is zero-padded)

    def __post_init__(self) -> None:
        # the kernel adds every output's min term in one vectorised pass over blocks, so it
        # reads the mins as [in / 32, out]: `mins` is the transposed view of that storage
        if (self.layout == "rows" and self.mins is not None
                and not self.mins.T.is_contiguous()):
            object.__setattr__(self, "mins", self.mins.T.contiguous().T)

    @property
    def out_features(self) -> int:
        return self.tiled_outputs if self.layout == "tiles" else self.scale.shape[0]

    @property
    def kernel_kind(self) -> int:
        """The kind number `kvpark_quant_linear` (and csrc/layer_ops.c) take."""
        return KINDS[self.kind] + (2 if self.layout == "tiles" else 0)

    def tiled(self) -> QuantizedWeight:
        """The same blocks laid out for csrc/quant_tiles.c: outputs in tiles of 16, each block
        of a tile a B tile in VNNI order (row g: inputs 4g..4g+3 of the 16 outputs); Q4_1 packs
        rows g and g + 4 of a block into one byte's low and high nibbles."""
        assert self.layout == "rows"
        out, nb = self.scale.shape
        tiles = -(-out // TILE_OUTPUTS)
        pad = tiles * TILE_OUTPUTS - out

        def per_tile(values: torch.Tensor) -> torch.Tensor:  # [out, nb, ..] -> [tiles, nb, 16, ..]
            padded = torch.nn.functional.pad(values, (0, 0) * (values.dim() - 1) + (0, pad))
            return padded.reshape(tiles, TILE_OUTPUTS, nb, *values.shape[2:]).transpose(1, 2)

        if self.kind == "Q4_1":  # the inputs in order: low nibbles 0..15, high nibbles 16..31
            values = torch.cat([self.quants & 15, self.quants >> 4], dim=-1)
        else:
            values = self.quants.view(torch.uint8)
        # [tiles, nb, 16 outputs, 8 groups, 4] -> [tiles, nb, 8 groups, 16 outputs, 4]
        vnni = per_tile(values.reshape(out, nb, 8, 4)).transpose(2, 3)
        if self.kind == "Q4_1":
            vnni = vnni[:, :, :4] | (vnni[:, :, 4:] << 4)
        return QuantizedWeight(
            self.kind, per_tile(self.scale).contiguous(),
            None if self.mins is None else per_tile(self.mins).contiguous(),
            vnni.contiguous(), layout="tiles", tiled_outputs=out)

    @property
    def in_features(self) -> int:
        return self.scale.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        parts = (self.scale, self.mins, self.quants)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, out_features: int) -> QuantizedWeight:
        """raw: the tensor's bytes as GGUF stores them, row by row."""
        import numpy as np

        blocks = np.ascontiguousarray(raw).reshape(out_features, -1, BLOCK_BYTES[kind])
        scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0]
                                 .astype(np.float32))
        if kind == "Q4_1":
            mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]
                                    .astype(np.float32))
            return cls(kind, scale, mins, torch.from_numpy(blocks[..., 4:].copy()))
        quants = torch.from_numpy(blocks[..., 2:].copy().view(np.int8))
        return cls(kind, scale, None, quants)

    def take_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The output rows `rows` (a permutation, e.g. undoing GGUF's RoPE pairing)."""
        assert self.layout == "rows"
        return QuantizedWeight(self.kind, self.scale[rows].contiguous(),
                               None if self.mins is None else self.mins[rows].contiguous(),
                               self.quants[rows].contiguous())

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
        """Output rows stacked (fused qkv, gate_up); None unless all parts share one format."""
        assert all(p.layout == "rows" for p in parts)
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
            return None
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(parts[0].kind, torch.cat([p.scale for p in parts]), mins,
                               torch.cat([p.quants for p in parts]))

def quant_linear(x: torch.Tensor, weight: QuantizedWeight, isa: Isa | None = None,
                 num_threads: int | None = None) -> torch.Tensor:
    """x [rows, in] float32 (dense rows) -> x W^T [rows, out] float32; outputs split between
    `num_threads` (default: `worker_pool.get_num_threads()`) threads, the bits unchanged."""
    assert x.dtype == torch.float32 and x.stride(-1) == 1, "float32 rows with dense features"
    assert (weight.layout == "tiles" or weight.mins is None
            or weight.mins.T.is_contiguous()), "mins stored block-major"
    rows = x.shape[0]
    y = torch.empty(rows, weight.out_features)
    mins = weight.mins.data_ptr() if weight.mins is not None else None
    status = load_kernel(isa)(weight.kernel_kind, weight.scale.data_ptr(), mins,
                           weight.quants.data_ptr(), weight.out_features, weight.in_features,
                           x.data_ptr(), x.stride(0), rows, y.data_ptr(), y.stride(0),
                           None, num_threads or worker_pool.get_num_threads())
    if status == 2:
        raise MemoryError("quantised linear kernel: no memory for the quantised activations")
    if status != 0:
        raise RuntimeError(f"quantised linear kernel failed (status {status})")
    return y


class TilePath(enum.IntEnum):
    """How csrc/quant_tiles.c computes a call (every path gives the same bits)."""

    AUTO = 0  # AMX tiles from a few rows on where they run, else AVX-512 vectors, else C
    VECTOR = 1  # AVX-512 (VNNI) vectors
    AMX = 2  # AMX int8 tiles
    SCALAR = 3  # plain C: the definition, runs anywhere


@functools.cache
def load_tiles_kernel(isa: Isa | None = None):
    lib = load_library(isa)
    fn = lib.kvpark_quant_tiles
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i32, ptr, ptr, ptr, i32, i32, ptr, i64, i32, ptr, i64, i32, i32]
    fn.restype = i32
    return fn


def tile_path_runs(path: TilePath, isa: Isa | None = None) -> bool:
    """Whether this CPU (and OS, for AMX) runs `path` of the tiles kernel."""
    return bool(load_library(isa).kvpark_quant_tiles_usable(int(path)))


def quant_tiles(x: torch.Tensor, weight: QuantizedWeight, path: TilePath = TilePath.AUTO,
                isa: Isa | None = None, num_threads: int | None = None) -> torch.Tensor:
    """`quant_linear` of a tiled weight along a chosen path (tests and benchmarks compare them)."""
    assert weight.layout == "tiles" and x.dtype == torch.float32 and x.stride(-1) == 1
    y = torch.empty(x.shape[0], weight.out_features)
    mins = weight.mins.data_ptr() if weight.mins is not None else None
    status = load_tiles_kernel(isa)(KINDS[weight.kind], weight.scale.data_ptr(), mins,
                                    weight.quants.data_ptr(), weight.out_features,
                                    weight.in_features, x.data_ptr(), x.stride(0), x.shape[0],
                                    y.data_ptr(), y.stride(0),
                                    num_threads or worker_pool.get_num_threads(), int(path))
    if status == -1:
        raise KernelUnavailable(f"the tiles kernel's {path.name} path does not run here")
    if status == 2:
        raise MemoryError("quantised tiles kernel: out of memory")
    if status != 0:
        raise RuntimeError(f"quantised tiles kernel failed (status {status})")
    return y
