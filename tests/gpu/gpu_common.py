"""Constants shared by the GPU tests (a plain module: `conftest` names clash across folders)."""

import torch

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
