"""Fixtures for tests/operator. The helpers live in kmock_harness.py (a unique module name: the
tests tree has several conftest.py files, so test modules never import this one)."""

from __future__ import annotations

import os

import pytest
from kmock_harness import find_helm

# The timer that re-creates children is declared when kvpark.operator.handlers is imported.
os.environ["KVPARK_RECONCILE_SECONDS"] = "1"


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        message = "no helm: run `bash scripts/install_helm.sh .venv/bin`"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing helm is a broken set-up there
        pytest.skip(message)
    return path
