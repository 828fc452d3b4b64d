"""The linears of a model on the CPU or CUDA: weights packed once for oneDNN, rows padded so a
row's result never depends on which other rows share the step (`batch_invariant`), and rows of
generated tokens read a GGUF's quantised blocks (`BlockRows`) where the model has them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpark.kernels import amx_gemm, cpu_features
from kvpark.kernels.amx_gemm import Rows
from kvpark.kernels.quant_linear import QuantizedWeight, TilePath, quant_linear, tile_path_runs

# A GEMM of very few rows takes a different kernel whose sums round differently: oneDNN (the CPU
# path here) for 1 row, MKL's sgemm (F.linear) for 1-3 rows on one thread and up to 11 on two.
# From 4 rows on, oneDNN gives every row the same bits whatever the row count, on any number of
# threads; padding to it makes each row's result independent of the batch it rides in.
MIN_INVARIANT_ROWS = 4
# oneDNN JIT-compiles a primitive for every GEMM shape it meets and keeps it in two caches of
# 1024 entries each (its own primitive cache and ideep's LRU in torch), ~0.6 MB of code and
# buffers apiece whatever the row count (measured: 512 row counts through one linear, +300 MiB).
# Row counts are a prompt chunk's length, so distinct prompt lengths filled both caches: RSS
# grew ~700 MiB on synthetic:tiny, then kept creeping with the caches' evict-and-rebuild churn
# (issue 23). The packed GEMMs therefore run a bounded set of row counts: exact up to
# EXACT_GEMM_ROWS (decode steps), above that rounded up to one of GEMM_ROWS_PER_OCTAVE steps per
# power of two (<= 25% padding rows, ~8% on average): 33 shapes a linear up to 512 rows. The
# padding rows are zeros sliced off the result; from MIN_INVARIANT_ROWS on oneDNN gives a row
# the same bits at any row count, so they never change a real row.
EXACT_GEMM_ROWS = 16
GEMM_ROWS_PER_OCTAVE = 4


class WeightFormat(str, enum.Enum):
    """How the big linears (attention, MLP, lm_head) hold their weights."""

    FP32 = "fp32"  # the checkpoint's values; fp32 products and sums (exact)
    BF16 = "bf16"  # half the bytes to read; weights, inputs and outputs rounded to bf16 (opt-in)
    # where AMX runs (the default there): weights and inputs rounded to bf16 for the tiles'
    # products, float32 sums and outputs; everything after the GEMM stays float32
    AMX_BF16 = "amx-bf16"


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:  # torch raises on CPUs without AVX-512 or AVX-NE-CONVERT
        return cpu_features.detect().can_bf16_gemm
    return weight.dtype == torch.float32


def uses_amx(fmt: WeightFormat, weight: torch.Tensor) -> bool:
    """bf16 linears run in the AMX tile kernel: a CPU weight where AMX runs."""
    return (fmt in (WeightFormat.BF16, WeightFormat.AMX_BF16) and weight.device.type == "cpu"
            and amx_gemm.usable())


def tiles_blocks(fmt: WeightFormat, weight: torch.Tensor) -> bool:
    """Blocks run in the tiles kernel (csrc/quant_tiles.c: AMX int8 tiles from a few rows,
    AVX-512 vectors below, the same bits) where AMX runs: faster than quant_linear.c at every
    row count measured there (benchmarks/README.md, "Decode rows on AMX int8 tiles"). Elsewhere
    quant_linear.c's row kernel stays (its speed on other CPUs is what was measured)."""
    return uses_amx(fmt, weight) and tile_path_runs(TilePath.AMX)


def block_layout(fmt: WeightFormat, device: torch.device) -> str:
    """Which kernel decode rows' blocks take (part of what decides the output's bits)."""
    return "tiles" if device.type == "cpu" and tiles_blocks(fmt, torch.empty(0)) else "rows"


def gemm_engine(fmt: WeightFormat, device: torch.device) -> str:
    """What computes the dense linears' products (part of what decides the output's bits)."""
    if device.type != "cpu":
        return "torch"
    return "amx" if uses_amx(fmt, torch.empty(0)) else "onednn"


@dataclass(frozen=True)
class BlockRows:
    """Which rows of a step read a linear's quantised blocks, and which the dense weight.

    The runner marks the rows of generated tokens (positions past the prompt), first fed or
    replayed: a property of the sequence alone, so a row takes the same kernels whatever its
    neighbours, however its prompt was chunked, and a recompute replay reproduces its bits.
    """

    blocks: torch.Tensor  # row indices, int64
    dense: torch.Tensor
    # (first, stop) where the rows of a kind are one run, as a step's usually are (its decode
    # rows come first): they are taken as views and put back as one copy, not gathered
    blocks_run: tuple[int, int] | None = None
    dense_run: tuple[int, int] | None = None

    @classmethod
    def from_mask(cls, from_blocks: list[bool]) -> BlockRows:
        mask = torch.tensor(from_blocks, dtype=torch.bool)
        return cls(mask.nonzero()[:, 0], (~mask).nonzero()[:, 0],
                   one_run(from_blocks, True), one_run(from_blocks, False))

    def take(self, t: torch.Tensor, dense: bool) -> torch.Tensor:
        """The rows of `t` of one kind (a view where they are one run)."""
        run = self.dense_run if dense else self.blocks_run
        if run is not None:
            return t[run[0]:run[1]]
        return t.index_select(0, self.dense if dense else self.blocks)

    def put(self, out: torch.Tensor, dense: bool, rows: torch.Tensor) -> None:
        """out's rows of one kind = `rows`."""
        run = self.dense_run if dense else self.blocks_run
        if run is not None:
            out[run[0]:run[1]].copy_(rows)
        else:
            out.index_copy_(0, self.dense if dense else self.blocks, rows)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_dense(self) -> int:
        return self.dense.shape[0]

    @classmethod
    def all_dense(cls, num_rows: int) -> BlockRows:
        return cls(torch.empty(0, dtype=torch.long), torch.arange(num_rows), (0, 0),
                   (0, num_rows))


def one_run(mask: list[bool], kind: bool) -> tuple[int, int] | None:
    """(first, stop) of the entries equal to `kind` where they are one run (or none), else
    None."""
    at = [i for i, m in enumerate(mask) if m == kind]
    if not at:
        return (0, 0)
    return (at[0], at[-1] + 1) if at[-1] + 1 - at[0] == len(at) else None


class Linear:
    """y = x W^T (+ b); on the CPU the weight is reordered once into oneDNN's blocked layout.

    A decode step's GEMMs have a handful of rows, so they stream the weight: oneDNN with a
    prepacked weight streams it faster than MKL's sgemm and is faster at prefill too (MKL takes
    its AVX2 path on AMD; measured in benchmarks/README.md). On CUDA: `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 fmt: WeightFormat = WeightFormat.FP32,
                 blocks: QuantizedWeight | None = None) -> None:
        if blocks is not None and tiles_blocks(fmt, weight):
            blocks = blocks.tiled()
        self.blocks = blocks  # the checkpoint's quantised blocks: decode rows read these
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = torch.bfloat16 if fmt is WeightFormat.BF16 else weight.dtype
        if fmt is WeightFormat.AMX_BF16 and not uses_amx(fmt, weight):
            raise ValueError("amx-bf16 linears need a CPU where AMX runs")
        # bf16 on AMX: kvpark's tile kernel, invariant at any row count (oneDNN's AMX kernels
        # are not, so oneDNN is kept below AMX: kernels/onednn_isa.py)
        self.amx = amx_gemm.pack(weight) if uses_amx(fmt, weight) else None
        weight = weight.to(self.compute_dtype)
        self.bias = None if bias is None else bias.to(self.compute_dtype)
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, MIN_INVARIANT_ROWS)
                       if self.amx is None and can_prepack(weight) else None)
        # one copy of the weights in RAM
        self.weight = None if self.packed is not None or self.amx is not None else weight

    def __call__(self, x: Rows, rows: BlockRows | None = None) -> torch.Tensor:
        """With `rows`, the rows it names read the quantised blocks (when there are any); x as
        A tiles (`reads_tiles`) only where every row is dense."""
        if isinstance(x, amx_gemm.ATiles):
            assert rows is None or rows.num_blocks == 0, "A tiles are for dense rows only"
            return self.dense(x)
        if rows is None:  # the model padded x for the dense GEMM
            return self.dense(x)
        # the model does not pad when it hands `rows` down: the dense GEMM keeps its row
        # invariance only from MIN_INVARIANT_ROWS rows on, the block kernel at any count
        if self.blocks is None or rows.num_blocks == 0:
            return self.dense(pad_rows(x, MIN_INVARIANT_ROWS))[: x.shape[0]]
        if rows.num_dense == 0:
            return self.from_blocks(x)
        out = torch.empty(x.shape[0], self.blocks.out_features, dtype=x.dtype)
        dense_x = pad_rows(rows.take(x, dense=True), MIN_INVARIANT_ROWS)
        rows.put(out, True, self.dense(dense_x)[: rows.num_dense])
        rows.put(out, False, self.from_blocks(rows.take(x, dense=False)))
        return out

    @property
    def reads_tiles(self) -> bool:
        """Dense rows may come as the AMX GEMM's A tiles (`amx_gemm.ATiles`) a producer wrote."""
        return self.amx is not None

    @property
    def fuses_add(self) -> bool:
        """`dense_add` runs: float32 sums on AMX and no bias."""
        return self.amx is not None and self.bias is None and self.compute_dtype == torch.float32

    @property
    def fuses_silu(self) -> bool:
        """`dense_silu` runs: as `fuses_add`, and halves of whole 16-output blocks."""
        return self.fuses_add and amx_gemm.fuses_silu(self.amx)

    def dense_add(self, x: Rows, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T for dense float32 rows, the sum in the AMX GEMM's last pass over its
        outputs (the bits of `residual + dense(x)`)."""
        return amx_gemm.gemm_add(x, self.amx, residual)

    def dense_silu(self, x: Rows, tiles: bool = False) -> torch.Tensor | amx_gemm.ATiles:
        """silu(g) * u of this [gate; up] linear's outputs for dense rows, in the AMX GEMM's
        epilogue (the bits of `dense` then `layer_ops.silu_mul`); with `tiles`, as the A tiles
        of the GEMM that reads them next."""
        return amx_gemm.gemm_silu(x, self.amx, tiles=tiles)

    def from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.blocks)
        return y if self.bias is None else y + self.bias

    def dense(self, x: Rows) -> torch.Tensor:
        out_dtype = torch.float32 if isinstance(x, amx_gemm.ATiles) else x.dtype
        if self.amx is not None:  # float32 sums of bf16 products
            y = amx_gemm.gemm(x, self.amx)
            y = y if self.bias is None else y + self.bias
            # bf16 linears round the output as oneDNN's bf16 GEMM does; amx-bf16 keeps float32
            y = y.to(self.compute_dtype)
            return y if y.dtype == out_dtype else y.to(out_dtype)
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.packed is not None:  # a bounded set of row counts (see EXACT_GEMM_ROWS)
            num_rows = x.shape[0]
            x = pad_rows(x, get_gemm_rows(num_rows))
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            y = y[:num_rows]
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if y.dtype == out_dtype else y.to(out_dtype)


def linear(x: Rows, layer: Linear, rows: BlockRows | None = None) -> torch.Tensor:
    """Every GEMM of the model goes through here, `linear_add` or `linear_silu`
    (benchmarks/profile_step.py times them)."""
    return layer(x, rows)


def linear_add(x: Rows, layer: Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + x W^T for dense rows through a linear whose `fuses_add` holds."""
    return layer.dense_add(x, residual)


def linear_silu(x: Rows, gate_up: Linear, tiles: bool = False) -> torch.Tensor | amx_gemm.ATiles:
    """silu(g) * u of dense rows x through a [gate; up] linear whose `fuses_silu` holds (as A
    tiles with `tiles`)."""
    return gate_up.dense_silu(x, tiles)


def get_gemm_rows(num_rows: int) -> int:
    """The row count a packed GEMM of `num_rows` rows runs with: `num_rows` up to
    EXACT_GEMM_ROWS, else rounded up to a multiple of 1/GEMM_ROWS_PER_OCTAVE of the power of
    two below it (17 -> 20, 33 -> 40, 257 -> 320, 512 -> 512)."""
    if num_rows <= EXACT_GEMM_ROWS:
        return num_rows
    step = (1 << (num_rows - 1).bit_length()) // (2 * GEMM_ROWS_PER_OCTAVE)
    return -(-num_rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it has enough)."""
    return x if x.shape[0] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))
