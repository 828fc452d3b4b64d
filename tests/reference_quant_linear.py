"""The arithmetic of `kernels/quant_linear.py`'s C kernel, written again in torch: what the
tests hold the kernel to (a plain module: `conftest` names clash)."""

import torch

from kvpark.kernels.quant_linear import BLOCK, QuantizedWeight


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 [out, in], as gguf's dequantisation gives it."""
    if weight.kind == "Q4_1":
        q = torch.cat([weight.quants & 15, weight.quants >> 4], dim=-1).float()
        w = q * weight.scale[..., None] + weight.mins[..., None]
    else:
        w = weight.quants.float() * weight.scale[..., None]
    return w.reshape(weight.out_features, weight.in_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (q [rows, in / 32, 32] int8, d [rows, in / 32]): the kernel's 8-bit
    activations, d = max|x| / 127 per block, q = x * (127 / max|x|) rounded to nearest even."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv).to(torch.int8), (amax / 127.0)[..., 0]


def reference_quant_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """What the kernel computes, in float64 from the same integers (the kernel's float sums
    differ only in rounding order)."""
    q, dx = quantize_activations(x)
    if weight.kind == "Q4_1":
        w = torch.cat([weight.quants & 15, weight.quants >> 4], dim=-1).long()
    else:
        w = weight.quants.long()
    isum = torch.einsum("rbi,obi->rob", q.long(), w).double()  # exact block sums
    y = (isum * weight.scale.double()[None] * dx.double()[:, None]).sum(-1)
    if weight.mins is not None:
        xsum = (dx * q.long().sum(-1).float()).double()  # float32 dx times the integer sum
        y += xsum @ weight.mins.double().T
    return y.float()


def random_blocks(kind: str, out_features: int, num_blocks: int, seed: int) -> QuantizedWeight:
    """Blocks of random quants and scales (Q4_1 with negative mins), seeded."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(out_features, num_blocks, generator=g) * 0.02
    if kind == "Q4_1":
        return QuantizedWeight(kind, scale, -torch.rand(out_features, num_blocks, generator=g),
                               torch.randint(0, 256, (out_features, num_blocks, 16),
                                             generator=g, dtype=torch.uint8))
    return QuantizedWeight(kind, scale, None, torch.randint(
        -128, 128, (out_features, num_blocks, 32), generator=g, dtype=torch.int8))
