"""--preempt-ram: explicit MiB, -1, 0 and auto from the container memory limit."""

import pytest

from kvpark.pod.memory import budget as b

MIB = b.MIB


def test_explicit_values():
    assert b.resolve_budget("8192").bytes == 8192 * MIB
    assert b.resolve_budget("0").bytes == 0
    assert b.resolve_budget("-1").bytes == -1
    with pytest.raises(ValueError):
        b.resolve_budget("-2")


def test_auto_is_limit_minus_resident_minus_headroom():
    limit, rss = 16384 * MIB, 900 * MIB
    got = b.auto_budget(limit, "test", rss)
    assert got.bytes == limit - rss - int(limit * b.HEADROOM_FRACTION)
    small = b.auto_budget(2048 * MIB, "test", rss)  # headroom floor: 512 MiB
    assert small.bytes == 2048 * MIB - rss - 512 * MIB
    assert b.auto_budget(1024 * MIB, "test", rss).bytes == 0  # never below 0


def test_auto_without_a_limit_falls_back_to_the_default():
    assert b.auto_budget(None, "none", 10).bytes == b.DEFAULT_BUDGET_MIB * MIB


def test_limit_sources(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setenv("KVPARK_CGROUP_MEMORY_MAX", str(v2))
    monkeypatch.setenv("KVPARK_CGROUP_V1_LIMIT", str(v1))
    monkeypatch.delenv("KVPARK_MEMORY_LIMIT", raising=False)
    assert b.read_memory_limit()[0] is None
    v2.write_text("max\n")
    v1.write_text(str(1 << 62))  # v1's "no limit"
    assert b.read_memory_limit()[0] is None
    v1.write_text(str(3 * 1024 * MIB))
    assert b.read_memory_limit() == (3 * 1024 * MIB, str(v1))
    v2.write_text(str(4 * 1024 * MIB))
    assert b.read_memory_limit() == (4 * 1024 * MIB, str(v2))
    monkeypatch.setenv("KVPARK_MEMORY_LIMIT", str(5 * 1024 * MIB))  # the Downward API wins
    assert b.read_memory_limit() == (5 * 1024 * MIB, "KVPARK_MEMORY_LIMIT")
