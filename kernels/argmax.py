"""Greedy tokens: the index of each row's largest logit, in C (`csrc/argmax.c`).

torch's CPU argmax compares one value at a time: for a decode step of many rows over a ~50k
vocabulary it took longer than the lm head that wrote the logits (benchmarks/README.md). The C
kernel gives torch.argmax's answer by construction (the first index of the maximum; a NaN
counts as the largest value, the first NaN wins), rows split between the kernel threads.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from . import worker_pool
from .cbuild import library_or_none
from .cpu_features import Isa

log = logging.getLogger(__name__)


@functools.cache
def _kernel(isa: Isa | None = None) -> ctypes.CDLL | None:
    lib = library_or_none(log, "greedy tokens by torch.argmax", isa)
    if lib is None:
        return None
    lib.kvpark_argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.kvpark_argmax_rows.restype = None
    return lib


def row_argmax(logits: torch.Tensor, isa: Isa | None = None) -> list[int]:
    """logits: [rows, vocab] -> each row's argmax, as `logits.argmax(-1).tolist()` gives it:
    in C where it can take the rows (`isa`: the build, default the best this CPU has)."""
    if can_take(logits) and _kernel(isa) is not None:
        return c_row_argmax(logits, isa)
    return logits.argmax(dim=-1).tolist()


def c_row_argmax(logits: torch.Tensor, isa: Isa | None = None) -> list[int]:
    """`row_argmax` by the C kernel; rows it `can_take`, a build that loads."""
    lib = _kernel(isa)
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.kvpark_argmax_rows(logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr(),
                           worker_pool.get_num_threads())
    return out.tolist()


def can_take(logits: torch.Tensor) -> bool:
    """float32 rows on the CPU with dense values (any row stride), none empty."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1 and logits.shape[0] > 0)
