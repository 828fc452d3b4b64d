"""Latency percentiles and plots shared by the benchmarks: TTFT and inter-token latency.

matplotlib is optional (`pip install -e '.[bench]'`): without it the tables and JSON are written
and the plot is skipped with a message.
"""

from __future__ import annotations

import math
from pathlib import Path

PERCENTILES = (50, 90, 99)
LATENCY_HEADERS = ["ttft ms p50/p90/p99", "itl ms p50/p90/p99"]


def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{p}": percentile(values, p) for p in PERCENTILES}


def latency_summary(ttfts: list[float], itls: list[float]) -> dict[str, dict[str, float]]:
    """Seconds in, milliseconds out: {"ttft_ms": {"p50": ...}, "itl_ms": {...}, counts}."""
    return {"ttft_ms": percentiles([t * 1e3 for t in ttfts]),
            "itl_ms": percentiles([t * 1e3 for t in itls]),
            "num_ttft": len(ttfts), "num_itl": len(itls)}


def latency_cells(summary: dict) -> list[str]:
    """The two table cells of LATENCY_HEADERS."""
    return ["/".join(f"{summary[key][f'p{p}']:.0f}" for p in PERCENTILES)
            for key in ("ttft_ms", "itl_ms")]


def plot_latency(json_path: str | Path, series: dict[str, tuple[list[float], list[float]]],
                 title: str = "") -> Path | None:
    """CDFs of TTFT and inter-token latency per series (name -> (ttfts, itls) in seconds),
    written beside the JSON as a PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a server
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot written")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, which, label in ((axes[0], 0, "time to first token (ms)"),
                             (axes[1], 1, "inter-token latency (ms)")):
        for name, values in series.items():
            ms = sorted(v * 1e3 for v in values[which])
            if not ms:
                continue
            # a step per sample, marked: a series of one or two samples still shows
            ax.step([ms[0], *ms], [0.0, *((i + 1) / len(ms) for i in range(len(ms)))],
                    where="post", marker="." if len(ms) < 50 else None, label=name)
        for p in PERCENTILES:
            ax.axhline(p / 100, color="grey", linewidth=0.5, linestyle=":")
        ax.set_xscale("log")  # a stall or a park sits decades above the median
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(json_path).with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path
