"""A GGUF file's metadata and tensor index, read in one pass over a memory map.

`gguf.GGUFReader` builds numpy views of every part of every metadata value: SmolLM2's 49,152
tokens and 48,900 merges cost it seconds a file (most of a synthetic model's start, where the
file is opened only for its tokenizer; benchmarks/README.md, "Measurements behind code
comments"), for values that are plain strings. This reads the same format
(GGUF v2/v3, little-endian) into plain Python values with `struct`, and gives each tensor's bytes
as the numpy view GGUFReader gives (typed for float and integer tensors, the raw block bytes of a
row otherwise), which `gguf.quants.dequantize` takes as it is. `dequantize` turns a tensor's
blocks into float32 with gguf's own arithmetic: in C for the kinds models ship in most
(kernels/dequantize.py), in bigger groups than gguf's for the others.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvpark.kernels import dequantize as c_dequantize

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# tensors GGUFReader hands out typed; every other type is blocks, handed out as bytes
TYPED_TENSORS = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
# values one call of gguf's block arithmetic makes (4 MiB of float32): `gguf.quants.dequantize`
# makes 16 rows a call, and its Python loop over those groups was most of a GGUF's load
# (benchmarks/README.md, "Measurements behind code comments")
DEQUANTIZE_GROUP_VALUES = 1 << 20


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # read-only, over the file's memory map


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: mmap.mmap | bytes, path: Path) -> None:
        self.buffer = buffer
        self.path = path
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: not a whole GGUF file (it ends at byte "
                             f"{len(self.buffer)}, inside its header)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise ValueError(f"{self.path}: not a whole GGUF file (a string in its header runs "
                             "past its end)")
        text = bytes(self.buffer[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array()
        if kind not in SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        return self.unpack(SCALARS[kind])

    def array(self) -> list[Any]:
        kind, count = self.unpack("<I"), self.unpack("<Q")
        if kind in NUMPY_TYPES:  # numbers in one read, not one struct call each
            values = np.frombuffer(self.buffer, NUMPY_TYPES[kind], count, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(kind) for _ in range(count)]


def read_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer, path)
    if buffer[:4] != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it does not start with {MAGIC!r})")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (a big-endian file, or one older or "
                         "newer than 2-3) is not supported")
    num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata = {}
    for _ in range(num_fields):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    index = [_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    whole = np.frombuffer(buffer, np.uint8)
    return GGUFFile(metadata, [_tensor(whole, start, *info, path) for info in index])


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
    return name, dims, cursor.unpack("<I"), cursor.unpack("<Q")


def _tensor(whole: np.ndarray, start: int, name: str, dims: tuple[int, ...], kind: int,
            offset: int, path: Path) -> GGUFTensor:
    tensor_type = GGMLQuantizationType(kind)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    np_shape = tuple(reversed(dims))  # outermost first
    num_elements = int(np.prod(dims, dtype=np.int64))
    num_bytes = num_elements // block_size * type_size
    begin = start + offset
    if begin + num_bytes > whole.size:
        raise ValueError(f"{path}: not a whole GGUF file (tensor {name!r} runs past its end)")
    raw = whole[begin:begin + num_bytes]
    if tensor_type in TYPED_TENSORS:
        return GGUFTensor(name, dims, tensor_type, raw.view(TYPED_TENSORS[tensor_type])
                          .reshape(np_shape))
    row_bytes = np_shape[-1] // block_size * type_size
    return GGUFTensor(name, dims, tensor_type, raw.reshape(*np_shape[:-1], row_bytes))


def dequantize(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """A tensor as `gguf.quants.dequantize` gives it (float32, the shape its values make): the
    block kinds the C kernel knows in C (kernels/dequantize.py), the others by their quant
    class's own `dequantize_rows` over groups of about DEQUANTIZE_GROUP_VALUES values (the same
    arithmetic, so the same bits)."""
    if data.ndim < 2 or kind in TYPED_TENSORS:
        return gguf.quants.dequantize(data, kind)
    rows = data.reshape(-1, data.shape[-1])
    block_size, type_size = GGML_QUANT_SIZES[kind]
    per_row = rows.shape[1] // type_size * block_size
    if c_dequantize.can_take(kind):  # the same arithmetic, a block read once
        return c_dequantize.dequantize_rows(rows, kind, block_size, type_size).reshape(
            *data.shape[:-1], per_row)
    quant = getattr(gguf.quants, kind.name, None)
    if not hasattr(quant, "dequantize_rows"):  # a gguf release without it
        return gguf.quants.dequantize(data, kind)
    group = max(1, DEQUANTIZE_GROUP_VALUES // per_row)
    out = np.concatenate([quant.dequantize_rows(rows[i:i + group])
                          for i in range(0, rows.shape[0], group)])
    return out.reshape(*data.shape[:-1], per_row)
