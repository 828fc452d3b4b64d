"""The layering the architecture promises, read from the source: the scheduler and the policy
decide and never touch kernels; only the memory layer, the model and the runner do; the API
reaches the engine through its facade only."""

import ast
from pathlib import Path

POD = Path(__file__).resolve().parents[2] / "pod"


def imports(module: str) -> set[str]:
    tree = ast.parse((POD / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            prefix = "kvpark.pod." if node.level else ""
            found.add(prefix + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_decisions_never_import_kernels():
    for module in ("scheduler", "preemption", "step_plan", "engine", "api", "slot"):
        kernel_imports = {m for m in imports(module) if m.startswith("kvpark.kernels")}
        assert not kernel_imports, f"pod/{module}.py imports {kernel_imports}"


def test_the_api_sees_the_engine_only():
    assert "kvpark.pod.scheduler" not in imports("api")
    source = (POD / "api.py").read_text()
    assert ".scheduler" not in source and ".pool" not in source


def test_scheduler_stays_small():
    assert len((POD / "scheduler.py").read_text().splitlines()) <= 250


def test_test_file_basenames_are_unique():
    """pytest's prepend import mode imports test files by basename: two with one name make the
    whole run fail at collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
