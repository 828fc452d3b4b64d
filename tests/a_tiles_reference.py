"""Activations as an AMX GEMM's A tiles (kernels/csrc/a_tiles.h), laid out in torch: the
reference the kernels that write A tiles (RMSNorm, SwiGLU, prompt attention) are held to."""

import torch


def reference_tiles(rows: torch.Tensor) -> torch.Tensor:
    """rows [m, k] float32 as the A tiles' bf16 layout, in torch: row tiles of 16 and blocks of
    32 columns, zero-padded, block by block."""
    m, k = rows.shape
    padded = torch.zeros(-(-m // 16) * 16, -(-k // 32) * 32, dtype=torch.bfloat16)
    padded[:m, :k] = rows.bfloat16()
    tiles = padded.view(-1, 16, padded.shape[1] // 32, 32).permute(0, 2, 1, 3)
    return tiles.contiguous().view(-1).view(torch.int16)
