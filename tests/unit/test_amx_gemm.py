"""The AMX bf16 GEMM (issue 41, first step): the B tiles' packed layout; a row's bits do not
depend on how many rows came with it, where it sat in its tile, or the thread count, at 1..600
rows and several offsets; the result is the bf16-rounded product to float32 accuracy. The
scalar emulation (same layout, tiling and order) runs everywhere; the AMX tiles where the CPU
and OS run them."""

import sys
from pathlib import Path

import pytest
import torch

from kvpark.kernels import amx_gemm, layer_ops
from kvpark.kernels.cbuild import KernelUnavailable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from a_tiles_reference import reference_tiles  # noqa: E402

ROWS = (1, 2, 15, 16, 17, 31, 33, 64, 100, 255, 257, 600)
OFFSETS = (0, 1, 7, 16, 23)
MODES = [pytest.param(True, id="emulated"),
         pytest.param(False, id="amx", marks=pytest.mark.skipif(
             not amx_gemm.usable(), reason="this CPU or OS does not run AMX tiles"))]


def operands(n: int, k: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same bf16 inputs, multiplied and summed in float64."""
    return x.bfloat16().double() @ w.bfloat16().double().T


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_packed_layout_is_the_b_tiles():
    n, k = 20, 40  # a partial output block and a partial input block: zero padding
    w, _ = operands(n, k, 1)
    packed = amx_gemm.pack(w).data.view(torch.bfloat16)
    kbs = 2
    bf = w.bfloat16()
    for nb, kb, p, j, h in [(0, 0, 0, 0, 0), (0, 1, 3, 5, 1), (1, 0, 15, 3, 1), (1, 1, 2, 0, 0),
                            (1, 1, 15, 15, 1)]:
        row, col = 16 * nb + j, 32 * kb + 2 * p + h
        got = packed[((nb * kbs + kb) * 16 + p) * 32 + j * 2 + h]
        want = bf[row, col] if row < n and col < k else torch.tensor(0, dtype=torch.bfloat16)
        assert got.view(torch.int16) == want.view(torch.int16), (nb, kb, p, j, h)


@pytest.mark.parametrize("emulate", MODES)
@pytest.mark.parametrize("n,k,rows,offsets", [
    # three output blocks (an odd group), three input blocks, the last partial
    (40, 80, ROWS, OFFSETS),
    # whole output blocks: row counts of whole tiles write y in place, others a buffer; 19
    # input blocks: B fits in L1, A loaded past it
    (48, 600, ROWS, OFFSETS),
    # 32 input blocks: one pass, A loaded into L1 (B does not fit there)
    (48, 1000, (1, 16, 17, 33, 64), (0, 7)),
    # 66 input blocks: two passes over the row tiles (K_CHUNK), the C tiles kept between
    (48, 2100, (1, 16, 17, 33, 64), (0, 7))])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(emulate, n, k, rows, offsets):
    w, x = operands(n, k, max(rows) + max(offsets))
    packed = amx_gemm.pack(w)
    assert_rows_alone(lambda rows: amx_gemm.gemm(rows, packed, emulate=emulate), x, rows, offsets)


def assert_rows_alone(gemm, x: torch.Tensor, rows, offsets) -> None:
    """Each run of `m` rows from `offset` on gives the bits those rows got with all of x."""
    whole = gemm(x)
    for m in rows:
        for offset in offsets:
            assert same_bits(gemm(x[offset:offset + m]), whole[offset:offset + m]), (m, offset)


@pytest.mark.parametrize("emulate", MODES)
def test_the_thread_count_changes_no_bit(emulate):
    w, x = operands(72, 96, 50)
    packed = amx_gemm.pack(w)
    one = amx_gemm.gemm(x, packed, emulate=emulate, num_threads=1)
    for threads in (2, 3, 5):
        assert same_bits(amx_gemm.gemm(x, packed, emulate=emulate, num_threads=threads), one)


@pytest.mark.parametrize("emulate", MODES)
def test_the_result_is_the_bf16_product_to_float32_accuracy(emulate):
    for k in (576, 2100):  # one pass over k, and two (the C tiles stored and loaded between)
        w, x = operands(48, k, 33)
        got = amx_gemm.gemm(x, amx_gemm.pack(w), emulate=emulate).double()
        want = reference(x, w)
        scale = (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T)
        assert ((got - want).abs() <= k * 2 ** -24 * scale + 1e-30).all()


@pytest.mark.skipif(amx_gemm.usable(), reason="AMX runs here")
def test_without_amx_the_tile_path_says_so_and_writes_nothing():
    w, x = operands(16, 32, 4)
    with pytest.raises(KernelUnavailable, match="AMX is not usable here"):
        amx_gemm.gemm(x, amx_gemm.pack(w))


# ---- the gate and up projections with SwiGLU as the epilogue (gemm_silu) -----------------------
@pytest.mark.parametrize("emulate", MODES)
@pytest.mark.parametrize("n,k,threads", [
    (64, 96, 2),      # two parts: gate block j with up block j, not with its neighbour
    (96, 2100, 3),    # three parts, two passes over k, a thread count that splits them unevenly
])
def test_the_silu_epilogue_gives_the_bits_of_the_gemm_then_silu_mul(emulate, n, k, threads):
    w, x = operands(n, k, 600)
    packed = amx_gemm.pack(w)
    assert amx_gemm.fuses_silu(packed)
    for m in ROWS:
        rows = x[:m]
        want = layer_ops.silu_mul(amx_gemm.gemm(rows, packed, emulate=emulate))
        got = amx_gemm.gemm_silu(rows, packed, emulate=emulate, num_threads=threads)
        assert got.shape == (m, n // 2)
        assert same_bits(got, want), m


@pytest.mark.parametrize("emulate", MODES)
def test_a_rows_swiglu_bits_do_not_depend_on_the_rows_beside_it(emulate):
    w, x = operands(64, 200, max(ROWS) + max(OFFSETS))
    packed = amx_gemm.pack(w)
    assert_rows_alone(lambda rows: amx_gemm.gemm_silu(rows, packed, emulate=emulate), x, ROWS,
                      OFFSETS)


def test_the_silu_epilogue_takes_only_halves_of_whole_blocks():
    assert not amx_gemm.fuses_silu(amx_gemm.pack(torch.zeros(48, 32)))  # halves of 24 outputs
    with pytest.raises(AssertionError, match="whole blocks of 16"):
        amx_gemm.gemm_silu(torch.zeros(2, 32), amx_gemm.pack(torch.zeros(48, 32)), emulate=True)


# ---- a residual added in the GEMM's last pass (gemm_add) ------------------------------------
@pytest.mark.parametrize("emulate", MODES)
@pytest.mark.parametrize("n,k", [(40, 80), (48, 600), (48, 2100)])  # a partial block; whole
def test_the_residual_epilogue_gives_the_bits_of_the_gemm_then_the_add(emulate, n, k):
    w, x = operands(n, k, 600)
    residual = torch.randn(600, n, generator=torch.Generator().manual_seed(1))
    packed = amx_gemm.pack(w)
    for m in ROWS:
        want = residual[:m] + amx_gemm.gemm(x[:m], packed, emulate=emulate)
        got = amx_gemm.gemm_add(x[:m], packed, residual[:m], emulate=emulate, num_threads=3)
        assert same_bits(got, want), m
        assert same_bits(residual[:m], torch.randn(600, n, generator=torch.Generator(
            ).manual_seed(1))[:m])  # the residual is read, not written


# ---- activations a producer writes as A tiles (ATiles) --------------------------------------
@pytest.mark.parametrize("k", [576, 40])  # whole blocks of 32, and a last block cut short
def test_a_norm_writes_the_a_tiles_of_its_float32_rows(k):
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(300, k, generator=g), torch.rand(k, generator=g) + 0.5
    for m in ROWS[:-1]:  # up to 257 rows
        tiles = layer_ops.rms_norm_tiles(x[:m], weight, 1e-5, num_threads=2)
        assert (tiles.rows, tiles.cols) == (m, k)
        want = reference_tiles(layer_ops.rms_norm(x[:m], weight, 1e-5))
        assert torch.equal(tiles.data, want), m


@pytest.mark.parametrize("emulate", MODES)
@pytest.mark.parametrize("n", [128, 96])  # SwiGLU halves of 64 (whole blocks) and 48 (not)
def test_a_gemm_reads_a_producers_tiles_as_it_would_read_the_rows(emulate, n):
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(300, 72, generator=g), torch.rand(72, generator=g) + 0.5
    gate_up, down = amx_gemm.pack(torch.randn(n, 72, generator=g)), amx_gemm.pack(
        torch.randn(40, n // 2, generator=g))
    residual = torch.randn(300, 40, generator=g)
    for m in (1, 15, 16, 17, 100, 300):
        h = layer_ops.rms_norm(x[:m], weight, 1e-5)
        act = amx_gemm.gemm_silu(h, gate_up, emulate=emulate)
        want = residual[:m] + amx_gemm.gemm(act, down, emulate=emulate)
        h_tiles = layer_ops.rms_norm_tiles(x[:m], weight, 1e-5)
        act_tiles = amx_gemm.gemm_silu(h_tiles, gate_up, emulate=emulate, tiles=True)
        assert torch.equal(act_tiles.data, reference_tiles(act)), m
        got = amx_gemm.gemm_add(act_tiles, down, residual[:m], emulate=emulate)
        assert same_bits(got, want), m
        assert same_bits(amx_gemm.gemm(h_tiles, gate_up, emulate=emulate),
                         amx_gemm.gemm(h, gate_up, emulate=emulate)), m
