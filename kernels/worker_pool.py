"""How many threads the C kernels use: the process-wide setting for `csrc/worker_pool.c`.

The pool's workers are created once per process (on the first call that needs them), spin for at
most 100 us after a kernel call and then sleep, so they never compete with torch's prefill GEMMs
for long. Threads split a call's outputs (quantised linear: output rows; attention: sequence x
KV head x row tile), never an output's sum: the bits do not depend on the count.
"""

from __future__ import annotations

from .cores import usable_cores

_num_threads = 1
MAX_THREADS = 64  # csrc/worker_pool.c: MAX_WORKERS (63) and the calling thread


def default_num_threads() -> int:
    """Every core this process may keep busy (`cores.usable_cores`), up to the pool's size: the
    most `--kernel-threads 0` tries; the server's start-up measurement keeps it only where 5%
    faster than 1 (benchmarks/README.md, Round 3)."""
    return min(MAX_THREADS, usable_cores().count)


def set_num_threads(num_threads: int) -> None:
    global _num_threads
    assert 1 <= num_threads <= MAX_THREADS, f"kernel threads must be 1..{MAX_THREADS}"
    _num_threads = num_threads


def get_num_threads() -> int:
    return _num_threads


def num_workers(isa=None) -> int:
    """Workers the pool has started in this process (for tests)."""
    from .cbuild import load_library

    return load_library(isa).kvpark_pool_workers()
