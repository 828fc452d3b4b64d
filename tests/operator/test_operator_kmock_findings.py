"""What a real API server showed that the EMULATED one (kmock, see kmock_harness.py) did not
(issue 24), end to end: real kopf and the real `kubernetes` client against kmock on 127.0.0.1
and, with $KUBECONFIG (marker `cluster`), against that real API server (conftest.py's `cluster`).

EMULATED on kmock beyond kmock_harness.py's own notes: server-side apply's typing of a Deployment
(`kmock_harness.typed_apply`: an unknown field or a value of another type is a 500, as
kube-apiserver v1.36 answers it); the Deployment and HorizontalPodAutoscaler controllers (the
tests write the status they write; where no custom metrics API is registered for the HPA).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from kmock_harness import Cluster, condition, typed_apply

from kvpark.operator import crd, handlers
from kvpark.operator.config import OperatorConfig

KMOCK_ADMISSION = [typed_apply]


def ours(cluster: Cluster, method: str, plural: str, ns: str) -> list:
    return [r for r in cluster.server.requests() if r.method == method and r.resource
            and r.resource.plural == plural and r.namespace == ns
            and r.headers.get("User-Agent", "").startswith("kvpark-operator/")]


@pytest.mark.parametrize("pod_spec, named", [
    ({"bogusField": 1}, "spec.podTemplate.spec.bogusField: field not declared"),
    ({"hostname": ["a"]}, "spec.podTemplate.spec.hostname: expected string, got array"),
    ({"containers": [{"name": "server", "env": [{"name": "A", "valu": "1"}]}]},
     "spec.podTemplate.spec.containers[0].env[0].valu: field not declared"),
], ids=["unknown field", "wrong type", "nested typo"])
def test_a_pod_template_the_api_server_cannot_type_is_child_rejected(
        cluster: Cluster, ns: str, pod_spec: dict, named: str) -> None:
    """Issue 24: server-side apply answered 500 `failed to create typed patch object ... field
    not declared in schema`, the PreemptServer said Degraded/ApiError and retried forever. Now
    the patch is checked against the PodSpec first: ChildRejected naming the field, one Event,
    nothing applied; fixing the spec applies it."""
    cluster.create_server(ns, "s", {"podTemplate": {"spec": pod_spec}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "ChildRejected")
    assert named in condition(server, "Degraded")["message"]
    time.sleep(2.5)  # two more reconciles (KVPARK_RECONCILE_SECONDS=1)
    if cluster.server:  # kmock's log; on a real cluster, the missing Deployment says it
        assert ours(cluster, "PATCH", "deployments", ns) == []  # nothing sent to fail
    assert cluster.get("Deployment", ns, "s") is None
    assert [e["reason"] for e in events_about(cluster, ns, crd.KIND)] == ["ChildRejected"]
    cluster.patch_spec(ns, "s", {"podTemplate": None})
    cluster.wait_child("Deployment", ns, "s")
    cluster.wait_condition(ns, "s", "Degraded", "False", "AsExpected")


def test_a_foreign_deployment_of_the_same_name_lends_no_status(cluster: Cluster, ns: str
                                                               ) -> None:
    """Issue 24: a PreemptServer named like a team's Deployment took its Ready and Progressing
    text from it (`0/1 updated`; here even Ready, from the team's ready pods). Now the conflict
    is what Ready and Progressing say, and no replica is counted."""
    cluster.api.create(cluster.path("Deployment", ns), {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}})
    if cluster.server:  # a real Deployment controller writes its own (0 ready, no kubelet)
        cluster.set_deployment_status(ns, "web", observedGeneration=1, replicas=3,
                                      readyReplicas=3, updatedReplicas=0, availableReplicas=3)
    cluster.create_server(ns, "web", {})
    server = cluster.wait_condition(ns, "web", "Degraded", "True", "NameConflict")
    ready, progressing = condition(server, "Ready"), condition(server, "Progressing")
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert (progressing["status"], progressing["reason"]) == ("False", "NameConflict")
    for said in (ready["message"], progressing["message"]):
        assert said.startswith("Deployment web already exists, not owned by this PreemptServer")
        assert "updated" not in said and "replicas ready" not in said
    assert (server["status"]["replicas"], server["status"]["readyReplicas"]) == (0, 0)


FAILING = {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
           "message": "the HPA was unable to compute the replica count: unable to get metric "
                      "kvpark_requests_preempted: no custom metrics API (custom.metrics."
                      "k8s.io) registered", "lastTransitionTime": "2026-01-02T03:04:05Z"}
ABLE = {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale",
        "message": "the HPA controller was able to get the target's current scale",
        "lastTransitionTime": "2026-01-02T03:04:05Z"}


def test_an_autoscaler_that_cannot_read_its_metric_is_degraded(cluster: Cluster, ns: str
                                                               ) -> None:
    """Issue 24: the PreemptServer said Degraded=False/AsExpected while its HPA said
    ScalingActive=False/FailedGetPodsMetric (no custom metrics API). Now it is Degraded with the
    HPA's reason and message, an Event says so once, and it clears when the HPA scales."""
    cluster.create_server(ns, "s", {"autoscaling": {"maxReplicas": 3}})
    cluster.wait_child("HorizontalPodAutoscaler", ns, "s")
    hpa_status = cluster.path("HorizontalPodAutoscaler", ns, "s", "status")
    if cluster.server:  # kmock: write what the HPA controller writes without a metrics API
        cluster.wait_condition(ns, "s", "Degraded", "False", "AsExpected")
        cluster.api.patch(hpa_status, {"status": {"currentReplicas": 1, "desiredReplicas": 0,
                                                  "conditions": [ABLE, FAILING]}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "AutoscalerNotScaling",
                                    timeout=60)
    message = condition(server, "Degraded")["message"]
    assert "HorizontalPodAutoscaler s: ScalingActive=False (FailedGetPodsMetric)" in message
    assert "kvpark_requests_preempted" in message
    assert condition(server, "Ready")["reason"] != "AutoscalerNotScaling"  # still serving
    time.sleep(2.5)
    assert [e["reason"] for e in events_about(cluster, ns, crd.KIND)] == ["AutoscalerNotScaling"]
    if cluster.server is None:
        return  # a real HPA here has no custom metrics API to read from: it stays failing
    cluster.api.patch(hpa_status, {"status": {"conditions": [ABLE, {
        **FAILING, "status": "True", "reason": "ValidMetricFound", "message": "ok"}]}})
    cluster.wait_condition(ns, "s", "Degraded", "False", "AsExpected")


def events_about(cluster: Cluster, ns: str, kind: str) -> list[dict]:
    """The namespace's Events about objects of `kind` (a real cluster's controllers add more)."""
    events = (cluster.api.get(f"/api/v1/namespaces/{ns}/events") or {}).get("items", [])
    return [e for e in events if e["involvedObject"]["kind"] == kind]


def test_a_pod_template_past_the_annotation_limit_is_applied_and_nothing_is_kept_in_the_object(
        cluster: Cluster, ns: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 38 (1.2): a podTemplate over 256 KiB made kopf's copy of the spec in an annotation
    too long for the API server; that write failed forever while the status said Ready. Now the
    operator keeps nothing in the PreemptServer but its status: the Deployment gets the whole
    template, a later change of the spec is applied, and no annotation (nor any write to the
    object itself: kmock's request log) comes from the operator."""
    env = [{"name": f"V{i}", "value": "x" * 1024} for i in range(300)]  # ~330 KB
    sidecar = {"name": "sidecar", "image": "busybox", "env": env}
    cluster.create_server(ns, "big", {"podTemplate": {"spec": {"containers": [sidecar]}}})
    deployment = cluster.wait_child("Deployment", ns, "big")
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert len(containers["sidecar"]["env"]) == 300
    cluster.wait_condition(ns, "big", "Degraded", "False", "AsExpected")
    cluster.patch_spec(ns, "big", {"parallel": 3})
    cluster.wait_child("Deployment", ns, "big", lambda d: parallel_of(d) == "3")
    annotations = cluster.get(crd.KIND, ns, "big")["metadata"].get("annotations") or {}
    assert [k for k in annotations if "kopf" in k or k.startswith(crd.GROUP)] == []
    if cluster.server:
        writes = ours(cluster, "PATCH", "preemptservers", ns)
        assert writes and {r.subresource for r in writes} == {"status"}
    # what a real API server answered kopf's annotation write: 422, retried for ever
    assert not [r.getMessage() for r in caplog.records if "Too long" in r.getMessage()]


def parallel_of(deployment: dict) -> str:
    server = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "server")
    return server["args"][server["args"].index("--parallel") + 1]


def test_a_protected_namespace_gets_no_children(cluster: Cluster, ns: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38 (1.6): an operator allowed everywhere could start pods in kube-system through a
    PreemptServer. The cluster's own namespaces (KVPARK_PROTECTED_NAMESPACES; kube-system,
    kube-public and kube-node-lease by default) are refused: Degraded, ProtectedNamespace, and
    nothing made. Here the test's namespace stands in for kube-system."""
    monkeypatch.setattr(handlers, "CONFIG", dataclasses.replace(
        handlers.CONFIG, protected_namespaces=(ns,)))
    cluster.create_server(ns, "s", {})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "ProtectedNamespace")
    assert f"not served in {ns}" in condition(server, "Degraded")["message"]
    assert cluster.get("Deployment", ns, "s") is None
    assert cluster.get("Service", ns, "s") is None


def test_the_cluster_namespaces_are_protected_by_default() -> None:
    config = OperatorConfig.from_env({})
    assert set(config.protected_namespaces) == {"kube-system", "kube-public", "kube-node-lease"}
    assert OperatorConfig.from_env({"KVPARK_PROTECTED_NAMESPACES": ""}).protected_namespaces == ()
