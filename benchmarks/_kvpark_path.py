"""Make `import kvpark` work from a plain checkout, without installing it (the GPU machine).

The distribution maps kvpark -> kvpark_pkg/, kvpark.pod -> pod/, kvpark.kernels -> kernels/,
kvpark.operator -> operator/ (setuptools package-dir). A shim folder holding a `kvpark` package
of symlinks gives the same names. The checkout itself must never go on sys.path: its top-level
`operator/` would shadow the standard library's `operator` and break Python at start-up.

    python3 benchmarks/_kvpark_path.py /tmp/kvpark_shim    # prints the folder for PYTHONPATH
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"__init__.py": "kvpark_pkg/__init__.py", "pod": "pod", "kernels": "kernels",
                "operator": "operator"}


def make_shim(shim_dir: Path, repo: Path = REPO) -> Path:
    package = shim_dir / "kvpark"
    package.mkdir(parents=True, exist_ok=True)
    for name, target in PACKAGE_DIRS.items():
        link = package / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(repo / target)
    return shim_dir


def ensure_kvpark() -> None:
    """Use the installed kvpark if there is one; otherwise put a fresh shim on sys.path."""
    if importlib.util.find_spec("kvpark") is not None:
        return
    shim = make_shim(Path(tempfile.mkdtemp(prefix="kvpark_shim_")))
    sys.path.insert(0, str(shim))


if __name__ == "__main__":
    print(make_shim(Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())))
