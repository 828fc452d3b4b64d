"""What the runner and the start-up code read of any decoder (the llama family, the hybrids):
its dtype and device, the rows a batch-invariant GEMM pads to, and the head's logits."""

from __future__ import annotations

import torch
from torch import nn

from .linear import MIN_INVARIANT_ROWS, BlockRows, Linear, linear, pad_rows


class DecoderBase(nn.Module):
    embed: torch.Tensor  # [vocab, hidden]
    head: Linear
    batch_invariant: bool
    has_blocks: bool

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def min_rows(self) -> int:
        return MIN_INVARIANT_ROWS if self.batch_invariant else 1

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: BlockRows | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]; `rows`: which rows read the
        head's quantised blocks (a model with blocks only)."""
        if self.has_blocks and rows is not None:
            return linear(hidden, self.head, rows).float()
        num_rows = hidden.shape[0]
        return linear(pad_rows(hidden, self.min_rows), self.head)[:num_rows].float()
