"""GGUF blocks to float32 in C (`csrc/dequantize.c`): gguf's own arithmetic for the block kinds
models ship in most (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), a block read once instead of numpy's
pass over memory a step, rows split between the kernel threads. Other kinds, and a machine
without the C kernels, keep gguf's numpy path (`pod/model/gguf_file.py`)."""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

from . import worker_pool
from .cbuild import library_or_none
from .cpu_features import Isa

log = logging.getLogger(__name__)


@functools.cache
def _kernel(isa: Isa | None = None) -> ctypes.CDLL | None:
    lib = library_or_none(log, "GGUF blocks dequantised by gguf's numpy code", isa)
    if lib is None:
        return None
    lib.kvpark_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.kvpark_dequantize.restype = ctypes.c_int
    lib.kvpark_dequantize_kind.argtypes = [ctypes.c_int]
    lib.kvpark_dequantize_kind.restype = ctypes.c_int
    return lib


def can_take(kind: int, isa: Isa | None = None) -> bool:
    """Whether the C kernel dequantises GGMLQuantizationType `kind` here."""
    lib = _kernel(isa)
    return lib is not None and bool(lib.kvpark_dequantize_kind(int(kind)))


def dequantize_rows(rows: np.ndarray, kind: int, block_size: int, type_size: int,
                    isa: Isa | None = None) -> np.ndarray:
    """rows: [n, bytes] of whole blocks of a kind `can_take` -> float32 [n, values]."""
    blocks_a_row = rows.shape[1] // type_size
    rows = np.ascontiguousarray(rows)
    out = np.empty((rows.shape[0], blocks_a_row * block_size), dtype=np.float32)
    if rows.shape[0]:
        done = _kernel(isa).kvpark_dequantize(int(kind), rows.ctypes.data, rows.shape[0],
                                              blocks_a_row, out.ctypes.data,
                                              worker_pool.get_num_threads())
        assert done == 0, f"kvpark_dequantize refused kind {kind}"
    return out
