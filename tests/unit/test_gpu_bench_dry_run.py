"""benchmarks/gpu_bench.py --dry-run: every CPU-capable section runs and its numbers add up."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_section(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"),
                           "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["errors"] == []
    assert report["decode"] and report["attention"] and report["parks"]
    chats = {row["budget"]: row for row in report["chats"]}
    assert list(chats) == ["ample", "inside park range", "0"]
    assert all(row["completed"] == "4/4" and row["agg_tok_s"] > 0 for row in chats.values())
    # the pool holds fewer than four chats: each budget parks, in the mode it allows
    assert chats["ample"]["swap"] > 0 and chats["ample"]["recompute"] == 0
    assert chats["0"]["swap"] == 0 and chats["0"]["recompute"] > 0
    assert chats["0"]["recomputed_tokens"] > 0
    assert "## Four concurrent chats" in (tmp_path / "gpu_bench.md").read_text()
