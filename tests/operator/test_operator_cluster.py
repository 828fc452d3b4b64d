"""The operator against a REAL cluster from $KUBECONFIG only (marker `cluster`; skipped without
one): what kmock cannot show at all. The API server's own validation (structural schema and
CEL), the Deployment controller writing the status that the PreemptServer's follows, and the
garbage collector taking the children. The tests shared with kmock are the test_operator_kmock*
modules (conftest.py's `cluster`); installing kvpark is test_operator_cluster_install.py.
Pods need no GPU (gpus: 0); with KVPARK_TEST_IMAGE set to a pushed kvpark image the lifecycle
test also waits for them to become Ready.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kmock_harness import RealCluster, condition

pytestmark = pytest.mark.cluster


@pytest.fixture
def ns(real_cluster: RealCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """conftest.py's `ns` on the real cluster only: a namespace and an operator watching it."""
    with real_cluster.test_namespace(request.node.name) as name:
        yield name


def spec() -> dict:
    image = os.environ.get("KVPARK_TEST_IMAGE")
    return {"resources": {"gpus": 0, "cpu": "1"}, "contextSize": 2048, "parallel": 2,
            **({"image": image} if image else {})}


@pytest.mark.parametrize("bad", [
    {"parallel": 0}, {"model": {"uri": "hf://org/repo"}},
    {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, {"preempt": {"ramMiB": "lots"}},
], ids=["minimum", "cel-revision", "cel-min-max", "type"])
def test_the_api_server_enforces_the_schema_and_cel(real_cluster: RealCluster, ns: str,
                                                    bad: dict) -> None:
    from kubernetes.client import ApiException

    with pytest.raises(ApiException) as refused:
        real_cluster.create_server(ns, "bad", bad)
    assert refused.value.status == 422, refused.value.body


@pytest.mark.parametrize("name", ["my.llm", "a" * 70, "Big", "9lives"])
def test_the_api_server_refuses_names_the_children_cannot_carry(real_cluster: RealCluster,
                                                                ns: str, name: str) -> None:
    """Issue 38 (1.3): the CEL rule on metadata.name (at the object's root: a fieldPath naming
    metadata.name is refused by the API server)."""
    from kubernetes.client import ApiException

    with pytest.raises(ApiException) as refused:
        real_cluster.create_server(ns, name, {})
    assert refused.value.status == 422 and "DNS-1035" in refused.value.body, refused.value.body


def test_lifecycle_on_a_real_cluster(real_cluster: RealCluster, ns: str) -> None:
    cluster = real_cluster
    server = cluster.create_server(ns, "s", spec())
    deployment = cluster.wait_child("Deployment", ns, "s", timeout=60)
    for kind in ("Deployment", "Service"):
        owner = cluster.wait_child(kind, ns, "s")["metadata"]["ownerReferences"][0]
        assert (owner["uid"], owner["controller"], owner["blockOwnerDeletion"]) == (
            server["metadata"]["uid"], True, True)

    cluster.patch_spec(ns, "s", {"parallel": 3})
    patched = cluster.wait_child("Deployment", ns, "s", lambda d: "3" in d["spec"]["template"][
        "spec"]["containers"][0]["args"], timeout=60)
    assert patched["metadata"]["uid"] == deployment["metadata"]["uid"]  # in place

    cluster.scale(ns, "s", 2)  # the real scale subresource
    cluster.wait_child("Deployment", ns, "s", lambda d: d["spec"]["replicas"] == 2, timeout=60)
    cluster.wait_child("PodDisruptionBudget", ns, "s", timeout=60)
    # the Deployment controller writes the status; the PreemptServer's follows it
    cluster.wait_child("PreemptServer", ns, "s",
                       lambda s: s.get("status", {}).get("replicas") == 2, timeout=120)
    if os.environ.get("KVPARK_TEST_IMAGE"):
        cluster.wait_condition(ns, "s", "Ready", "True", timeout=600)

    old = cluster.get("Service", ns, "s")
    cluster.delete("Service", ns, "s")
    cluster.wait_child("Service", ns, "s",
                       lambda s: s["metadata"]["uid"] != old["metadata"]["uid"], timeout=60)
    assert condition(cluster.get("PreemptServer", ns, "s"), "Degraded")["status"] == "False"

    cluster.delete("PreemptServer", ns, "s")  # the garbage collector takes the children
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        cluster.wait_gone(kind, ns, "s", timeout=120)
