"""Decode rows from blocks laid out for AMX int8 tiles (csrc/quant_tiles.c): the same integer
block sums as quant_linear.c in one float order that the AMX tiles, the AVX-512 vectors and
plain C all follow, so every path gives every row the same bits and a call's row count may
pick the path."""

import pytest
import torch
from reference_quant_linear import random_blocks, reference_quant_linear

from kvpark.kernels import quant_linear as ql
from kvpark.kernels.quant_linear import TilePath

pytestmark = pytest.mark.skipif(not ql.is_available(), reason="no working C compiler")

# rows across the AMX row tiles of 16 and the vectors' groups of 4, up to a long prompt's
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 64, 100, 257, 600)


def activations(rows: int, in_features: int, seed: int = 5) -> torch.Tensor:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[min(5, rows - 1)] *= 1e-3  # a row of small values: its own scales
    x[min(6, rows - 1)] = 0.0  # an all-zero row: zero scales
    return x


def runnable(path: TilePath) -> TilePath:
    if not ql.tile_path_runs(path):
        pytest.skip(f"the tiles kernel's {path.name} path does not run here (needs "
                    f"{'AVX-512 VNNI' if path is TilePath.VECTOR else 'AMX int8 and its OS'})")
    return path


PATHS = [pytest.param(p, id=p.name.lower()) for p in TilePath]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_features,num_blocks", [(37, 7), (50, 48), (16, 1)])
def test_each_path_computes_the_reference_arithmetic(kind, path, out_features, num_blocks, isa):
    """The tiled layout read back right (VNNI rows, nibble pairs, padded last tile): the
    float64 reference of the same integers, up to float rounding, for every output."""
    blocks = random_blocks(kind, out_features, num_blocks, seed=3)
    tiled = blocks.tiled()
    assert tiled.out_features == out_features and tiled.in_features == blocks.in_features
    x = activations(21, blocks.in_features)
    y = ql.quant_tiles(x, tiled, runnable(path), isa)
    reference = reference_quant_linear(x, blocks)
    assert ((y - reference).norm() / reference.norm()).item() < 2e-6
    assert torch.equal(y[6], torch.zeros_like(y[6]))


@pytest.mark.parametrize("path", [p for p in PATHS if p.values[0] is not TilePath.SCALAR])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("out_features,num_blocks", [(37, 7), (20, 41)])
def test_every_path_gives_each_row_the_bits_plain_c_gives_it_alone(kind, path, out_features,
                                                                    num_blocks, isa):
    """1 to 600 rows at several offsets through the AMX tiles or the vectors: each row
    byte-identical to the plain C definition run on that row alone (41 blocks: the AMX tiles
    take their sums in spans, the float sequence carried across)."""
    runnable(path)
    blocks = random_blocks(kind, out_features, num_blocks, seed=11).tiled()
    x = activations(max(ROW_COUNTS) + 3, blocks.in_features, seed=7)
    alone = torch.cat([ql.quant_tiles(x[i:i + 1], blocks, TilePath.SCALAR, isa)
                       for i in range(len(x))]).view(torch.int32)
    for rows in ROW_COUNTS:
        for first in sorted({0, 1, 3, len(x) - rows}):
            y = ql.quant_tiles(x[first:first + rows], blocks, path, isa, num_threads=2)
            assert torch.equal(y.view(torch.int32), alone[first:first + rows]), (rows, first)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_row_count_picks_the_path_and_keeps_a_rows_bits(kind, isa):
    """What the server calls (`quant_linear` on a tiled weight): vectors for a few rows, AMX
    tiles for more where they run; a row's bits stay those it has alone, also past the
    outputs' thread split."""
    blocks = random_blocks(kind, 200, 3, seed=2).tiled()
    x = activations(40, blocks.in_features, seed=9)
    alone = torch.cat([ql.quant_linear(x[i:i + 1], blocks, isa) for i in range(len(x))])
    for rows in range(1, 34):
        for first in (0, 4, len(x) - rows):
            y = ql.quant_linear(x[first:first + rows], blocks, isa, num_threads=2)
            assert torch.equal(y.view(torch.int32), alone[first:first + rows].view(torch.int32))


def test_the_tiled_layout_keeps_every_weight_once():
    """Each (output, input) weight sits once in the B tiles, where the VNNI order puts it."""
    for kind in ("Q4_1", "Q8_0"):
        blocks = random_blocks(kind, 20, 2, seed=4)
        tiled = blocks.tiled()
        if kind == "Q4_1":
            w = torch.cat([blocks.quants & 15, blocks.quants >> 4], dim=-1)
            packed = tiled.quants  # [tiles, nb, 4 rows, 16 outputs, 4]
            b_tile = torch.cat([packed & 15, packed >> 4], dim=2)
        else:
            w, b_tile = blocks.quants, tiled.quants.view(torch.int8)
        for o, b, i in [(0, 0, 0), (3, 1, 5), (17, 1, 31), (19, 0, 16)]:
            assert b_tile[o // 16, b, i // 4, o % 16, i % 4] == w[o, b, i]
        assert torch.equal(tiled.scale[1, :, 4:], torch.zeros(2, 12))  # outputs 20..31: padding
        assert torch.equal(tiled.scale[1, :, :4], blocks.scale[16:].T)
