"""Greedy tokens in C (kernels/argmax.py + csrc/argmax.c): torch.argmax's answer on every
build, at every lane and tail position, with ties, infinities, NaNs and signed zeros."""

import math

import pytest
import torch

from kvpark.kernels import argmax, worker_pool
from kvpark.kernels.cbuild import KernelUnavailable, load_library
from kvpark.pod.sampling.sampler import SamplingParams, sample

try:
    load_library()
    HAS_KERNELS = True
except KernelUnavailable:
    HAS_KERNELS = False
pytestmark = pytest.mark.skipif(not HAS_KERNELS, reason="no working C compiler")

# lengths around the AVX-512 (16) and AVX2 (8) vectors, and a vocabulary's
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 49152, 49155]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def expect(x: torch.Tensor) -> list[int]:
    return x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("n", LENGTHS)
def test_random_rows_give_torchs_argmax(isa, n):
    x = randn(37, n, seed=n)
    assert argmax.c_row_argmax(x, isa) == expect(x)


@pytest.mark.parametrize("n", [1, 9, 17, 40, 1000])
def test_the_first_of_tied_maxima_wins_at_every_position(isa, n):
    """A maximum repeated at two positions, for pairs of a lane and a later position (every
    pair up to 40 values): the earlier index, whichever lane or tail either sits in."""
    rows = []
    step = 1 if n <= 40 else 37
    for first in range(0, n, step):
        for second in range(first, n, step):
            row = torch.zeros(n).uniform_(-1, 1)
            row[first] = row[second] = 2.0
            rows.append(row)
    x = torch.stack(rows)
    got = argmax.c_row_argmax(x, isa)
    assert got == expect(x)
    assert got == [int(torch.nonzero(r == 2.0)[0]) for r in rows]


@pytest.mark.parametrize("n", [1, 5, 16, 23, 100])
def test_nans_infinities_and_signed_zeros_as_torch(isa, n):
    """A NaN is larger than any number (the first NaN wins), -inf rows give 0, -0 == +0."""
    rows = [torch.full((n,), -math.inf), torch.full((n,), math.inf), torch.zeros(n),
            -torch.zeros(n)]
    for at in range(n):
        for value in (math.nan, math.inf, -0.0):
            row = randn(n, seed=at)
            row[at] = value
            rows.append(row)
        row = torch.full((n,), -math.inf)
        row[at] = -1e30
        rows.append(row)
        row = torch.zeros(n)
        row[: at + 1] = -0.0
        rows.append(row)
    for first in range(0, n, 3):  # two NaNs, and a NaN beside +inf
        row = randn(n, seed=first)
        row[first] = row[n - 1] = math.nan
        rows.append(row)
        row = randn(n, seed=first)
        row[first], row[n - 1] = math.inf, math.nan
        rows.append(row)
    x = torch.stack(rows)
    assert argmax.c_row_argmax(x, isa) == expect(x)


def test_rows_of_a_wider_tensor_and_every_thread_count(isa):
    """A view with a row stride past its width (the head's rows of a padded step), split
    between 1..4 kernel threads: the same answer."""
    wide = randn(64, 1100, seed=3)
    x = wide[:, 7:1031]
    was = worker_pool.get_num_threads()
    try:
        for threads in (1, 2, 3, 4):
            worker_pool.set_num_threads(threads)
            assert argmax.c_row_argmax(x, isa) == expect(x)
    finally:
        worker_pool.set_num_threads(was)


def test_greedy_sampling_takes_the_c_kernel(monkeypatch):
    """The sampler's one argmax for every greedy row is this kernel's."""
    calls = []
    real = argmax.c_row_argmax
    monkeypatch.setattr(argmax, "c_row_argmax", lambda x, isa=None: calls.append(x) or real(x))
    logits = randn(3, 50)
    params = [SamplingParams(temperature=0)] * 3
    assert sample(logits, params, [torch.Generator()] * 3) == expect(logits)
    assert len(calls) == 1


def test_what_the_kernel_cannot_take_goes_to_torch():
    """Other dtypes, a transposed view, no rows: torch.argmax answers."""
    x = randn(5, 40)
    for other in (x.double(), x.to(torch.bfloat16), x.t(), x[:0]):
        assert not argmax.can_take(other)
        assert argmax.row_argmax(other) == expect(other)
