"""Test-wide settings: one torch thread (on 2 shared cores extra threads were 5-10x slower)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from kvpark.pod.worker.batch_invariance import cap_onednn  # noqa: E402

# as the server does at start, before anything asks oneDNN which ISA it may use: the in-process
# tests build batch-invariant models, which need AMX kept out of oneDNN where the CPU has it
cap_onednn(batch_invariant=True)

import pytest  # noqa: E402
from cpu_isa import runnable_isa  # noqa: E402

from kvpark.kernels.cpu_features import Isa  # noqa: E402


@pytest.fixture(params=list(Isa), ids=lambda isa: isa.value)
def isa(request) -> Isa:
    """Each C kernel build this CPU can run (see cpu_isa.py)."""
    return runnable_isa(request.param)
