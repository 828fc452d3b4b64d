"""Fixtures for tests/operator. The helpers live in kmock_harness.py (a unique module name: the
tests tree has several conftest.py files, so test modules never import this one).

`cluster` is the operator running against kmock (always) and, with the marker `cluster`, against
the real API server of $KUBECONFIG (skipped without one), so that one test asserts the same on
both. A module says what its kmock serves with KMOCK_RESOURCES (default CORE_RESOURCES) and
which admission checks it runs with KMOCK_ADMISSION; a test that only kmock can run calls
`kmock_harness.kmock_only(cluster, why)`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kmock_harness import (
    CORE_RESOURCES,
    Cluster,
    RealCluster,
    find_helm,
    has_kubeconfig,
    running_operator,
)

# The timer that re-creates children is declared when kvpark.operator.handlers is imported.
os.environ["KVPARK_RECONCILE_SECONDS"] = "1"
KUBECONFIG = os.environ.get("KUBECONFIG", "")


@pytest.fixture(scope="session")
def helm() -> str:
    path = find_helm()
    if path is None:
        message = "no helm: run `bash scripts/install_helm.sh .venv/bin`"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing helm is a broken set-up there
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    """The API server of $KUBECONFIG with kvpark's CRD (and stand-ins for other projects'
    CRDs where absent) installed; skips without a kubeconfig."""
    if not has_kubeconfig(KUBECONFIG):
        pytest.skip("no KUBECONFIG: a real cluster is needed")
    cluster = RealCluster(KUBECONFIG)
    try:
        cluster.install_crds()
        yield cluster
    finally:
        cluster.remove_stand_ins()


@pytest.fixture(scope="module",
                params=["kmock", pytest.param("cluster", marks=pytest.mark.cluster)])
def cluster(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if request.param == "cluster":
        yield request.getfixturevalue("real_cluster")
        return
    resources = getattr(request.module, "KMOCK_RESOURCES", CORE_RESOURCES)
    with running_operator(resources, tmp_path_factory.mktemp("kmock")) as emulated:
        emulated.server.emulator.admission.extend(getattr(request.module, "KMOCK_ADMISSION", []))
        yield emulated


@pytest.fixture
def ns(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own (on a real cluster: made, watched, removed after)."""
    with cluster.test_namespace(request.node.name) as name:
        yield name
