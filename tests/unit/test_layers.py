"""The layering the architecture promises, read from the source: no import circle; arrows between
the subpackages of pod/ point down only (http -> serving -> metrics -> requests -> core ->
worker -> memory/sampling -> model); decisions never touch kernels; the HTTP side reaches the
engine through its facade and the thread-boundary values only; the scheduler alone writes a
sequence's pages and counts."""

import ast
from pathlib import Path

POD = Path(__file__).resolve().parents[2] / "pod"
PKG = "kvpark.pod"
# top to bottom; a module may import from its own subpackage or from a lower one. `args` (the
# flags, parsed once) and the entry point sit outside the layers.
RANKS = {"http": 9, "serving": 8, "metrics": 7, "requests": 6, "core": 5, "worker": 4,
         "memory": 3, "sampling": 3, "model": 2, "args": 1}
# what the HTTP side may import from core: the engine's facade and the values that cross
HTTP_SEES_OF_CORE = {f"{PKG}.core.engine", f"{PKG}.core.messages"}
# the fields of a sequence only the scheduler writes
SEQUENCE_STATE = {"page_table", "num_computed", "num_cached", "page_hashes"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(POD).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


MODULES = {module_name(p): p for p in POD.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The pod modules (or packages) `name` imports, TYPE_CHECKING and function-local ones too."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or ({target} & MODULES.keys())
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & MODULES.keys()
        found |= set()
    return found - {name}


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 else ""


def external_imports(name: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def in_layer(*names: str) -> list[str]:
    return sorted(m for m in MODULES if layer(m) in names)


def test_no_module_imports_itself_through_others():
    graph = {m: imports(m) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_arrows_between_subpackages_point_down():
    upward = [(m, t) for m in MODULES if layer(m) in RANKS for t in imports(m)
              if layer(t) != layer(m) and layer(t) in RANKS
              and RANKS[layer(t)] >= RANKS[layer(m)]]
    assert upward == []


def test_every_module_is_in_a_layer():
    """A new folder must be placed in RANKS; at the root only the entry point and the flags."""
    assert {layer(m) for m in MODULES} - set(RANKS) == {"", "__main__"}


def test_decisions_never_import_kernels():
    decisions = [m for m in in_layer("core", "http", "requests") if m != f"{PKG}.core.swap"]
    for module in decisions:
        kernels = {i for i in external_imports(module) if i.startswith("kvpark.kernels")}
        assert not kernels, f"{module} imports {kernels}"


def test_the_http_side_sees_the_engine_facade_and_values_only():
    for module in in_layer("http"):
        of_core = {t for t in imports(module) if layer(t) == "core"}
        assert of_core <= HTTP_SEES_OF_CORE, f"{module} imports {of_core - HTTP_SEES_OF_CORE}"
        source = MODULES[module].read_text()
        assert ".scheduler" not in source and ".pool" not in source, module


def test_the_routes_read_their_slice_of_the_flags():
    """`HttpConfig` is what they read; the flags as a whole stay with the app and the builder."""
    for module in set(in_layer("http")) - {f"{PKG}.http.app", f"{PKG}.http.lifecycle",
                                           f"{PKG}.http.config", f"{PKG}.http.connections"}:
        source = MODULES[module].read_text()
        assert f"{PKG}.args" not in imports(module), module
        assert ".args." not in source and "args: ServerArgs" not in source, module


def test_only_the_http_side_reads_the_shared_server():
    readers = {m for m in MODULES if f"{PKG}.http.lifecycle" in imports(m)}
    assert {layer(m) for m in readers} <= {"http", "__main__"}


def writes_to(tree: ast.AST, fields: set[str]) -> list[str]:
    """Attribute stores (`x.f = ...`, `x.f += ...`, `del x.f[...]`) and in-place calls
    (`x.f.append(...)`) on the given field names."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) \
                else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in {"append", "extend", "insert", "pop", "clear", "remove"}:
            targets = [node.func.value]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr in fields:
                    found.append(f"line {node.lineno}: .{part.attr}")
    return found


def test_the_scheduler_alone_writes_a_sequences_pages_and_counts():
    writers = {m: writes_to(ast.parse(p.read_text()), SEQUENCE_STATE)
               for m, p in MODULES.items()}
    assert {m for m, found in writers.items() if found} == {f"{PKG}.core.scheduler"}, {
        m: found for m, found in writers.items() if found and m != f"{PKG}.core.scheduler"}


def test_scheduler_stays_one_concept():
    """Planning a step and taking in what it produced (what the engine did after a step
    moved here); a larger file would be doing something else too."""
    assert len((POD / "core" / "scheduler.py").read_text().splitlines()) <= 400


def test_test_file_basenames_are_unique():
    """pytest's prepend import mode imports test files by basename: two with one name make the
    whole run fail at collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
