"""The operator's own image (Dockerfile.operator): kopf, kubernetes and PyYAML, none of the
server's dependencies. No image is built here (no Docker engine): the Dockerfile is read, and the
operator is imported with every other dependency of the distribution blocked."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from kmock_harness import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DOCKERFILE = (REPO / "Dockerfile.operator").read_text()


def import_name(requirement: str) -> str:
    return re.split(r"[<>=\[ ;]", requirement, maxsplit=1)[0].replace("-", "_").lower()


def test_the_operator_imports_without_the_servers_dependencies() -> None:
    blocked = sorted(import_name(r) for r in PYPROJECT["project"]["dependencies"])
    assert {"torch", "numpy", "prometheus_client"} <= set(blocked)
    code = (
        "import pkgutil, sys, importlib\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "import kvpark.operator\n"
        "for m in pkgutil.iter_modules(kvpark.operator.__path__):\n"
        "    importlib.import_module('kvpark.operator.' + m.name)\n"
        "from kvpark.operator import validation\n"
        "assert validation.get_args_problems(['--ctx', '1'])\n"
        f"assert not any(sys.modules.get(n) for n in {blocked!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_dockerfile_installs_the_operator_extra_only() -> None:
    deps = re.search(r'ARG OPERATOR_DEPS="([^"]*)"', DOCKERFILE).group(1).split()
    assert deps == PYPROJECT["project"]["optional-dependencies"]["operator"]
    assert "pip install --no-deps /wheels/kvpark-*.whl" in DOCKERFILE
    assert not re.search(r"pip install[^\n]*torch", DOCKERFILE)
    assert "USER 10001:10001" in DOCKERFILE
    assert 'CMD ["kvpark-operator"]' in DOCKERFILE
    assert "FROM python:${PYTHON}-slim" in DOCKERFILE
