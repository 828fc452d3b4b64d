"""The C dequantiser (kernels/dequantize.py) gives the bytes gguf's numpy code gives, for every
kind it takes, on every build this CPU runs, at any row count and thread count; the loader's
`dequantize` sends those kinds to it and the others to gguf, and all of them to gguf where the
C kernels do not build."""

import logging

import gguf
import numpy as np
import pytest

from kvpark.kernels import cbuild, worker_pool
from kvpark.kernels import dequantize as c_dequantize
from kvpark.pod.model import gguf_file

C_KINDS = [gguf.GGMLQuantizationType[name] for name in
           ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")]


def random_blocks(kind, rows: int, blocks_a_row: int) -> np.ndarray:
    """Any bytes: scales of every exponent, infinities and NaNs among them."""
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    return np.random.default_rng(kind.value * 1000 + rows).integers(
        0, 256, (rows, blocks_a_row * type_size), dtype=np.uint8)


def gguf_gives(raw: np.ndarray, kind) -> np.ndarray:
    with np.errstate(all="ignore"):  # random scales overflow
        return gguf.quants.dequantize(raw, kind)


@pytest.mark.parametrize("rows", [1, 17, 40])
@pytest.mark.parametrize("kind", C_KINDS, ids=lambda k: k.name)
def test_every_build_gives_gguf_s_bytes(isa, kind, rows):
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = random_blocks(kind, rows, 3 * 256 // block_size)
    assert c_dequantize.can_take(kind, isa)
    ours = c_dequantize.dequantize_rows(raw, kind, block_size, type_size, isa)
    assert ours.tobytes() == gguf_gives(raw, kind).tobytes()


@pytest.mark.parametrize("kind", C_KINDS, ids=lambda k: k.name)
def test_the_thread_count_changes_nothing(kind):
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    raw = random_blocks(kind, 100, 2)
    before = worker_pool.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            worker_pool.set_num_threads(threads)
            got.append(c_dequantize.dequantize_rows(raw, kind, block_size, type_size).tobytes())
    finally:
        worker_pool.set_num_threads(before)
    assert got[0] == got[1] == got[2] == gguf_gives(raw, kind).tobytes()


def test_the_loader_sends_the_kinds_the_c_kernel_takes_to_it(monkeypatch):
    calls = []
    real = c_dequantize.dequantize_rows
    monkeypatch.setattr(c_dequantize, "dequantize_rows",
                        lambda rows, kind, *a: calls.append(kind) or real(rows, kind, *a))
    for kind in [*C_KINDS, gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q5_0]:
        raw = random_blocks(kind, 4, 256 // gguf.GGML_QUANT_SIZES[kind][0]).reshape(2, 2, -1)
        with np.errstate(all="ignore"):
            ours = gguf_file.dequantize(raw, kind)
        assert ours.shape == (2, 2, 256) and ours.tobytes() == gguf_gives(raw, kind).tobytes()
    assert calls == C_KINDS  # Q2_K and Q5_0: gguf's own code


def test_without_the_c_kernels_gguf_dequantises_and_the_log_says_so(monkeypatch, caplog):
    def unavailable(isa=None):
        raise cbuild.KernelUnavailable("no compiler in this test")

    monkeypatch.setattr(cbuild, "load_library", unavailable)
    c_dequantize._kernel.cache_clear()
    try:
        kind = gguf.GGMLQuantizationType.Q4_K
        raw = random_blocks(kind, 3, 2)
        with caplog.at_level(logging.INFO, logger="kvpark.kernels.dequantize"):
            with np.errstate(all="ignore"):
                ours = gguf_file.dequantize(raw, kind)
    finally:
        c_dequantize._kernel.cache_clear()
    assert ours.tobytes() == gguf_gives(raw, kind).tobytes()
    assert [r.getMessage() for r in caplog.records] == [
        "GGUF blocks dequantised by gguf's numpy code: no C kernels here (no compiler in this "
        "test)"]
