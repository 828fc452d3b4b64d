"""The preemption RAM budget: explicit MiB, or `auto` from the container's memory limit; and the
one rule of what a budget holds (`fits_budget`), which the park decision and the host store share.

auto = memory limit - resident size after the model loaded - headroom, never below 0, where the
headroom is max(512 MiB, 10% of the limit): room for activations, tokenizer, HTTP buffers and
allocator slack, so that parking never pushes the pod into the OOM killer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
UNLIMITED_BYTES = -1  # --preempt-ram -1 (and --cache-ram -1): no limit
DEFAULT_BUDGET_MIB = 8192
MIN_HEADROOM_BYTES = 512 * MIB
HEADROOM_FRACTION = 0.10
CGROUP_V2 = "/sys/fs/cgroup/memory.max"
CGROUP_V1 = "/sys/fs/cgroup/memory/memory.limit_in_bytes"
# cgroup v1 reports "no limit" as a huge page-aligned number
CGROUP_V1_UNLIMITED = 1 << 60


def fits_budget(num_bytes: int, budget_bytes: int, held_bytes: int) -> bool:
    """The one `--preempt-ram` rule, for the decision and for the store that keeps it: -1 has
    no limit, 0 holds nothing (always recompute), N holds at most N bytes in all."""
    if budget_bytes == UNLIMITED_BYTES:
        return True
    return budget_bytes > 0 and held_bytes + num_bytes <= budget_bytes


@dataclass(frozen=True)
class Budget:
    bytes: int  # UNLIMITED_BYTES: no limit
    source: str  # what decided it, for the start-up log

    def describe(self) -> str:
        amount = "no limit" if self.bytes == UNLIMITED_BYTES else f"{self.bytes / MIB:.0f} MiB"
        return f"{amount} ({self.source})"


def read_memory_limit() -> tuple[int | None, str]:
    """The container memory limit in bytes and where it came from, or (None, reason)."""
    env = os.environ.get("KVPARK_MEMORY_LIMIT")
    if env:
        return int(env), "KVPARK_MEMORY_LIMIT"
    v2 = Path(os.environ.get("KVPARK_CGROUP_MEMORY_MAX", CGROUP_V2))
    v1 = Path(os.environ.get("KVPARK_CGROUP_V1_LIMIT", CGROUP_V1))
    if v2.is_file():
        text = v2.read_text().strip()
        if text != "max":
            return int(text), str(v2)
    if v1.is_file():
        value = int(v1.read_text().strip())
        if value < CGROUP_V1_UNLIMITED:
            return value, str(v1)
    return None, "no memory limit found"


def resident_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def headroom_bytes(limit: int) -> int:
    return max(MIN_HEADROOM_BYTES, int(limit * HEADROOM_FRACTION))


def auto_budget(limit: int | None, source: str, rss: int) -> Budget:
    if limit is None:
        return Budget(DEFAULT_BUDGET_MIB * MIB, f"auto: {source}, default {DEFAULT_BUDGET_MIB} MiB")
    budget = max(0, limit - rss - headroom_bytes(limit))
    return Budget(
        budget,
        f"auto: limit {limit / MIB:.0f} MiB from {source} - resident {rss / MIB:.0f} MiB"
        f" - headroom {headroom_bytes(limit) / MIB:.0f} MiB",
    )


def resolve_budget(preempt_ram: str) -> Budget:
    """`--preempt-ram` as given ('auto', -1, 0 or MiB) -> a budget in bytes."""
    if preempt_ram == "auto":
        limit, source = read_memory_limit()
        return auto_budget(limit, source, resident_bytes())
    mib = int(preempt_ram)
    if mib < -1:
        raise ValueError(f"--preempt-ram must be -1, 0, a positive MiB count or auto, not {mib}")
    if mib == UNLIMITED_BYTES:
        return Budget(UNLIMITED_BYTES, "--preempt-ram -1")
    return Budget(mib * MIB, f"--preempt-ram {mib}")
