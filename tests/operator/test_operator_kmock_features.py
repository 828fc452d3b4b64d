"""The platform features end to end against the EMULATED API (kmock, see kmock_harness.py): a pod
template patch, a refused override, the model-cache claim and the InferencePool. kmock treats
server-side apply as a merge patch and validates nothing: whether a real API server takes the
patched pod template is the builders' tests' business (official schemas, strict)."""

from __future__ import annotations

import pytest
from kmock_harness import CORE_RESOURCES, INFERENCE_POOLS, Cluster, condition, running_operator

POD_TEMPLATE = {"metadata": {"annotations": {"team": "ml"}},
                "spec": {"priorityClassName": "inference-high",
                         "containers": [{"name": "server",
                                         "env": [{"name": "EXTRA", "value": "1"}]}]}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    resources = [*CORE_RESOURCES, INFERENCE_POOLS]
    with running_operator(resources, tmp_path_factory.mktemp("kmock")) as cluster:
        yield cluster


def test_pod_template_and_a_refused_override(cluster: Cluster) -> None:
    cluster.create_server("tpl", "s", {"podTemplate": POD_TEMPLATE})
    deployment = cluster.wait_child("Deployment", "tpl", "s")
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["team"] == "ml"
    assert template["spec"]["priorityClassName"] == "inference-high"
    env = [e["name"] for e in template["spec"]["containers"][0]["env"]]
    assert env[0] == "KVPARK_MEMORY_LIMIT" and env[-1] == "EXTRA"
    cluster.patch_spec("tpl", "s", {"podTemplate": {"spec": {"containers": [
        {"name": "server", "image": "evil:1", "env": [{"name": "EXTRA", "value": "1"}]}]}}})
    server = cluster.wait_condition("tpl", "s", "Degraded", "True", "OwnedField")
    assert "spec.containers[server].image" in condition(server, "Degraded")["message"]
    image = cluster.get("Deployment", "tpl", "s")["spec"]["template"]["spec"]["containers"][0][
        "image"]
    assert image != "evil:1"  # nothing applied


def test_cache_claim_and_inference_pool(cluster: Cluster) -> None:
    cluster.create_server("feat", "s", {
        "model": {"uri": "hf://O/R", "revision": "main", "sizeMiB": 100,
                  "cache": {"pvc": {"size": "20Gi", "storageClassName": "nfs"}}},
        "routing": {"inferencePool": {"endpointPicker": {"name": "epp"}}}})
    pvc = cluster.wait_child("PersistentVolumeClaim", "feat", "s")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    deployment = cluster.wait_child("Deployment", "feat", "s")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "s"}} in volumes
    pool = cluster.wait_child("InferencePool", "feat", "s")
    assert pool["spec"]["endpointPickerRef"]["name"] == "epp"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == pvc["metadata"]["ownerReferences"][
        0]["uid"]
    cluster.patch_spec("feat", "s", {"routing": None,
                                     "model": {"cache": {"pvc": {"size": None,
                                                                 "storageClassName": None,
                                                                 "claimName": "shared"}}}})
    cluster.wait_gone("InferencePool", "feat", "s")
    cluster.wait_gone("PersistentVolumeClaim", "feat", "s")  # ours, no longer wanted
    deployment = cluster.wait_child("Deployment", "feat", "s", lambda d: {
        "name": "model", "persistentVolumeClaim": {"claimName": "shared"}} in d["spec"][
        "template"]["spec"]["volumes"])
