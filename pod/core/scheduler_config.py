"""The scheduler's slice of the server's flags, in its own units (watermarks as shares)."""

from __future__ import annotations

from dataclasses import dataclass

from .speculation import SpecConfig


@dataclass(frozen=True)
class SchedulerConfig:
    num_slots: int
    batch_size: int = 512  # tokens per step, prefill chunks included
    # seconds a decode row may sit out steps while more prompt tokens wait than a step takes
    # (0: decode rows join every step)
    prefill_first: float = 0.0
    preempt: bool = True
    preempt_every: int = 0  # force a park + resume every N generated tokens (0: off)
    max_context: int = 1 << 30  # tokens one sequence may reach (finish_reason "length")
    preempt_high: float = 0.94  # park proactively when the next step would pass this share
    preempt_low: float = 0.80  # restore only while the pool stays below this share
    resume_order: str = "spec"  # or "fair" (head-of-line by park time)
    spec: SpecConfig = SpecConfig()  # speculative decoding (off by default)
