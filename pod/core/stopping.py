"""When a sampled token ends its sequence: the one place that decides (pure)."""

from __future__ import annotations

from .messages import FinishReason
from .sequence import Sequence


def stop_reason(seq: Sequence, is_eos: bool, max_context: int) -> FinishReason | None:
    """EOS, a stop string or a complete grammar stop it; the output limit or the context it may
    reach end it as "length"; None: it goes on."""
    if is_eos or (seq.output.visible is not None and seq.output.visible.stopped):
        return FinishReason.STOP
    if seq.constraint is not None and seq.constraint.is_done():
        return FinishReason.STOP
    left = seq.params.tokens_left(seq.num_generated)
    if left is not None and left <= 0:
        return FinishReason.LENGTH
    if len(seq.tokens) >= max_context:
        return FinishReason.LENGTH
    return None
