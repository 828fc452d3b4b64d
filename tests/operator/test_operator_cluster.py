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
from kmock_harness import RealCluster, condition, wait_for

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
    {"kvCache": {"disk": {"size": "0Gi"}}}, {"kvCache": {"disk": {"shared": True}}},
], ids=["minimum", "cel-revision", "cel-min-max", "type", "cel-kv-disk-size",
        "kv-disk-without-size"])
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


def claims(cluster: RealCluster, ns: str) -> list[dict]:
    listing = cluster.api.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims") or {}
    return listing.get("items") or []


def test_kv_cache_disk_claims_on_a_real_cluster(real_cluster: RealCluster, ns: str) -> None:
    """Issue 42, what only controllers show: a pod's ephemeral volume becomes a claim named
    <pod name>-kv-cache, owned by the pod (kube-controller-manager's ephemeral-volume
    controller, on a pod not even scheduled), and the shared claim goes with the PreemptServer
    (the garbage collector; the pvc-protection finalizer holds it only while a scheduled pod
    uses it). And what kmock takes: a change to the made claim's spec is refused."""
    cluster = real_cluster
    cluster.create_server(ns, "own", {**spec(), "kvCache": {"disk": {"size": "1Gi"}}})

    def pod_claim() -> dict | None:
        return next((c for c in claims(cluster, ns) if c["metadata"].get("ownerReferences")
                     and c["metadata"]["ownerReferences"][0]["kind"] == "Pod"), None)

    claim = wait_for("the pod's ephemeral claim", pod_claim, timeout=120)
    pod = claim["metadata"]["ownerReferences"][0]["name"]
    assert pod.startswith("own-") and claim["metadata"]["name"] == f"{pod}-kv-cache"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["metadata"]["labels"]["app.kubernetes.io/instance"] == "own"
    assert cluster.get("PersistentVolumeClaim", ns, "own-kv-cache") is None  # none of ours

    server = cluster.create_server(ns, "shared", {**spec(), "replicas": 2, "kvCache": {
        "disk": {"size": "1Gi", "storageClassName": "nfs", "shared": True}}})
    made = cluster.wait_child("PersistentVolumeClaim", ns, "shared-kv-cache", timeout=60)
    assert made["metadata"]["ownerReferences"][0]["uid"] == server["metadata"]["uid"]
    # a claim's spec is immutable (but for growing a bound one, or naming a class where an
    # unbound one had none): kmock takes the change, the API server refuses it, and the
    # PreemptServer says so
    cluster.patch_spec(ns, "shared", {"kvCache": {"disk": {"storageClassName": "other"}}})
    refused = cluster.wait_condition(ns, "shared", "Degraded", "True", "ChildRejected",
                                     timeout=60)
    assert "immutable" in condition(refused, "Degraded")["message"]
    kept = cluster.get("PersistentVolumeClaim", ns, "shared-kv-cache")
    assert kept["spec"]["storageClassName"] == "nfs"
    cluster.delete("PreemptServer", ns, "shared")
    cluster.wait_gone("PersistentVolumeClaim", ns, "shared-kv-cache", timeout=120)
