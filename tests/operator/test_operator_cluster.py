"""The operator against a REAL cluster from $KUBECONFIG (marker `cluster`; skipped without one).

It covers what the kmock tests cannot: the API server's own validation (structural schema and
CEL), the scale subresource, the Deployment controller writing status, and garbage collection of
the children when the PreemptServer goes. The operator runs in-process (kopf, watching only a
fresh namespace that the test makes and removes); the CRD is applied server-side, so the
kubeconfig needs cluster-admin-like rights. Pods need no GPU (gpus: 0); with KVPARK_TEST_IMAGE
set to a pushed kvpark image the test also waits for them to become Ready.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from kmock_harness import Api, Cluster, condition, wait_for

from kvpark.operator import crd

pytestmark = pytest.mark.cluster
KUBECONFIG = os.environ.get("KUBECONFIG", "")
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@pytest.fixture(scope="module")
def cluster():
    if not KUBECONFIG or not all(Path(p).is_file() for p in KUBECONFIG.split(os.pathsep)):
        pytest.skip("no KUBECONFIG: the cluster test needs a real cluster")
    from kopf.testing import KopfRunner
    from kubernetes import config as kconfig

    from kvpark.operator import kube
    from kvpark.operator.__main__ import get_kopf_args
    from kvpark.operator.config import OperatorConfig

    api = Api(kconfig.new_client_from_config(config_file=KUBECONFIG))
    name = f"{crd.PLURAL}.{crd.GROUP}"
    api.call("PATCH", f"{CRD_PATH}/{name}?fieldManager=kvpark-tests&force=true", crd.get_crd(),
             content_type="application/apply-patch+yaml")
    wait_for("the CRD to be established", lambda: any(
        c["type"] == "Established" and c["status"] == "True"
        for c in (api.get(f"{CRD_PATH}/{name}") or {}).get("status", {}).get("conditions", [])))
    namespace = f"kvpark-test-{uuid.uuid4().hex[:6]}"
    api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                      "metadata": {"name": namespace}})
    kube.reset()
    config = OperatorConfig(namespaces=(namespace,), liveness="")
    try:
        with KopfRunner(get_kopf_args(config), timeout=60):
            yield Cluster(api), namespace
    finally:
        api.delete(f"/api/v1/namespaces/{namespace}")


def spec() -> dict:
    image = os.environ.get("KVPARK_TEST_IMAGE")
    return {"resources": {"gpus": 0, "cpu": "1"}, "contextSize": 2048, "parallel": 2,
            **({"image": image} if image else {})}


def test_the_api_server_enforces_the_schema_and_cel(cluster) -> None:
    from kubernetes.client import ApiException

    api, ns = cluster
    for bad in ({"parallel": 0}, {"model": {"uri": "hf://org/repo"}},
                {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
                {"preempt": {"ramMiB": "lots"}}):
        with pytest.raises(ApiException) as refused:
            api.create_server(ns, "bad", bad)
        assert refused.value.status == 422, bad


def test_lifecycle_on_a_real_cluster(cluster) -> None:
    api, ns = cluster
    server = api.create_server(ns, "s", spec())
    deployment = api.wait_child("Deployment", ns, "s", timeout=60)
    for kind in ("Deployment", "Service"):
        owner = api.get(kind, ns, "s")["metadata"]["ownerReferences"][0]
        assert (owner["uid"], owner["controller"], owner["blockOwnerDeletion"]) == (
            server["metadata"]["uid"], True, True)

    api.patch_spec(ns, "s", {"parallel": 3})
    patched = api.wait_child("Deployment", ns, "s", lambda d: "3" in d["spec"]["template"][
        "spec"]["containers"][0]["args"], timeout=60)
    assert patched["metadata"]["uid"] == deployment["metadata"]["uid"]  # in place

    api.scale(ns, "s", 2)  # the real scale subresource
    api.wait_child("Deployment", ns, "s", lambda d: d["spec"]["replicas"] == 2, timeout=60)
    api.wait_child("PodDisruptionBudget", ns, "s", timeout=60)
    # the Deployment controller writes the status; the PreemptServer's follows it
    api.wait_child("PreemptServer", ns, "s", lambda s: s.get("status", {}).get("replicas") == 2,
                   timeout=120)
    if os.environ.get("KVPARK_TEST_IMAGE"):
        api.wait_condition(ns, "s", "Ready", "True", timeout=600)

    old = api.get("Service", ns, "s")
    api.delete("Service", ns, "s")
    api.wait_child("Service", ns, "s", lambda s: s["metadata"]["uid"] != old["metadata"]["uid"],
                   timeout=60)
    assert condition(api.get("PreemptServer", ns, "s"), "Degraded")["status"] == "False"

    api.delete("PreemptServer", ns, "s")  # the garbage collector takes the children
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        api.wait_gone(kind, ns, "s", timeout=120)
