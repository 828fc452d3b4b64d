"""The packed GEMMs' row counts: a bounded set, so oneDNN's per-shape caches stay small (issue 23),
and padding that never changes a real row's bits."""

from __future__ import annotations

import pytest
import torch

from kvpark.pod.model.linear import EXACT_GEMM_ROWS, Linear, get_gemm_rows

MAX_ROWS = 8192


def test_small_row_counts_run_as_they_are():
    assert [get_gemm_rows(n) for n in range(1, EXACT_GEMM_ROWS + 1)] == list(
        range(1, EXACT_GEMM_ROWS + 1))


def test_larger_row_counts_are_padded_by_at_most_a_quarter():
    for n in range(EXACT_GEMM_ROWS + 1, MAX_ROWS + 1):
        assert n <= get_gemm_rows(n) <= n * 1.25, n
        assert get_gemm_rows(get_gemm_rows(n)) == get_gemm_rows(n), n  # a fixed point


def test_row_counts_make_a_few_shapes_per_octave():
    # every step of up to --batch-size 512 tokens: 13 exact counts from MIN_INVARIANT_ROWS, then
    # 4 per power of two; a shape per row count would make 509
    assert len({get_gemm_rows(n) for n in range(4, 513)}) == 33
    assert len({get_gemm_rows(n) for n in range(4, MAX_ROWS + 1)}) == 13 + 4 * 9


@pytest.mark.parametrize("rows", [4, 17, 33, 100, 257, 511])
def test_padding_rows_never_change_a_real_row(rows):
    gen = torch.Generator().manual_seed(rows)
    layer = Linear(torch.randn(216, 72, generator=gen) * 0.05, None)
    x = torch.randn(640, 72, generator=gen)
    assert torch.equal(layer.dense(x[:rows]), layer.dense(x)[:rows])
