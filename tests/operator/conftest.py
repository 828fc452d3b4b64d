"""Fixtures for tests/operator. `operator_cluster` runs the real operator (kopf, in a thread)
against kmock, a Kubernetes API *emulator* on 127.0.0.1 (see kmock_harness.py for what it is
and is not)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from kmock_harness import Api, Cluster, KmockServer

# The timer that re-creates children is declared when kvpark.operator.handlers is imported.
os.environ["KVPARK_RECONCILE_SECONDS"] = "1"

REPO = Path(__file__).resolve().parents[2]


def find_helm() -> str | None:
    local = REPO / ".venv" / "bin" / "helm"
    return str(local) if local.is_file() else shutil.which("helm")


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        message = "no helm: run `bash scripts/install_helm.sh .venv/bin`"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing helm is a broken set-up there
        pytest.skip(message)
    return path


@contextlib.contextmanager
def running_operator(resources: list, workdir: Path) -> Iterator[Cluster]:
    """kmock with `resources` declared, and the operator running against it."""
    from kopf.testing import KopfRunner
    from kubernetes import config as kconfig

    from kvpark.operator import kube
    from kvpark.operator.__main__ import get_kopf_args
    from kvpark.operator.config import OperatorConfig

    with KmockServer(resources) as server:
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        saved = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(kubeconfig)
        kube.reset()
        cluster = Cluster(Api(kconfig.new_client_from_config(str(kubeconfig))), server)
        try:
            with KopfRunner(get_kopf_args(OperatorConfig(liveness="")), timeout=30) as runner:
                yield cluster
            assert runner.exit_code == 0, runner.output[-4000:]
        finally:
            if saved is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = saved
            kube.reset()
