"""The hook through which a sequence's output is constrained token by token (structured output,
tool calls): the runner masks the row's logits before sampling, the engine feeds back the
token it sampled. State lives on the `Sequence`, so it survives a park (swap or recompute)
as it is: a replay feeds tokens that were already accepted and samples none of them."""

from __future__ import annotations

from typing import Protocol

import torch


class TokenConstraint(Protocol):
    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens not allowed next to -inf, in place ([vocab] float32)."""

    def accept(self, token: int) -> None:
        """The token sampled for this sequence (never called for a replayed token)."""

    def is_done(self) -> bool:
        """The constrained output is complete: the sequence ends (finish reason `stop`)."""
