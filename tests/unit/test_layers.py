"""The layering the architecture promises, read from the source: the scheduler and the policy
decide and never touch kernels; only the memory layer, the model and the runner do; the API
reaches the engine through its facade only."""

import ast
from pathlib import Path

POD = Path(__file__).resolve().parents[2] / "pod"
# the HTTP side: the app's wiring and the modules split out of it
API_MODULES = ("api", "lifecycle", "auth", "admission", "request_body", "sse",
               "error_handlers", "build_info", "generation_routes", "model_routes",
               "open_routes", "slot_routes")


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
    for module in ("scheduler", "preemption", "step_plan", "engine", "slot") + API_MODULES:
        kernel_imports = {m for m in imports(module) if m.startswith("kvpark.kernels")}
        assert not kernel_imports, f"pod/{module}.py imports {kernel_imports}"


def test_the_api_sees_the_engine_only():
    for module in API_MODULES:
        assert "kvpark.pod.scheduler" not in imports(module), f"pod/{module}.py"
        source = (POD / f"{module}.py").read_text()
        assert ".scheduler" not in source and ".pool" not in source, f"pod/{module}.py"


def slot_names_imported(module: str) -> set[str]:
    tree = ast.parse((POD / f"{module}.py").read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module == "slot" for alias in node.names}


def test_the_http_side_never_names_a_sequence():
    """It submits values and reads values (`handover.py`); only the bridge's engine-thread
    side (`bridge.Reporter`) sees a sequence, and the thread-boundary test walks the rest."""
    for module in (*API_MODULES, "formats"):
        held = slot_names_imported(module) & {"Sequence", "ParkState"}  # SlotView: a value
        assert not held, f"pod/{module}.py imports {held}"


def test_the_routes_read_their_slice_of_the_flags():
    """`HttpConfig` is what they read; the flags as a whole stay with the app and the builder."""
    for module in set(API_MODULES) - {"api", "lifecycle"}:
        source = (POD / f"{module}.py").read_text()
        assert "kvpark.pod.args" not in imports(module), f"pod/{module}.py"
        assert ".args." not in source and "args: ServerArgs" not in source, f"pod/{module}.py"


def test_every_module_of_the_http_side_is_held_to_its_rules():
    """A new route group reads the shared `Server` (`lifecycle.py`): it must be in API_MODULES."""
    readers = {p.stem for p in POD.glob("*.py") if "kvpark.pod.lifecycle" in imports(p.stem)}
    assert readers - {"__main__"} <= set(API_MODULES)


def test_scheduler_stays_small():
    assert len((POD / "scheduler.py").read_text().splitlines()) <= 250


def test_test_file_basenames_are_unique():
    """pytest's prepend import mode imports test files by basename: two with one name make the
    whole run fail at collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
