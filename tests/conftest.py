"""Test-wide settings: one torch thread (on 2 shared cores extra threads were 5-10x slower)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
