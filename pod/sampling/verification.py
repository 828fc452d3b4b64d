"""Exact-match verification of a speculative draft (the design, and why it keeps the output
byte-identical: `core/speculation.py`)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq


def verify(draft: Seq[int], draw: Callable[[int], int]) -> list[int]:
    """Sample rows 0..len(draft) in order with `draw(row)`; stop after the first sample that
    differs from the next draft token. Returns the emitted tokens: the matched drafts, then the
    correction (or, all matched, the last row's token). Rows after a mismatch are never drawn,
    so the generator advances exactly as in plain decoding."""
    emitted: list[int] = []
    for row in range(len(draft) + 1):
        token = draw(row)
        emitted.append(token)
        if row == len(draft) or token != draft[row]:
            break
    return emitted
