"""Ownership and the autoscaler switch, end to end against an EMULATED Kubernetes API (kmock on
127.0.0.1, see kmock_harness.py) and, with $KUBECONFIG (marker `cluster`), a real one: real kopf
and the real `kubernetes` client (conftest.py's `cluster`).

EMULATED on kmock beyond kmock_harness.py's own notes: KEDA's validating admission webhook
(`kmock_harness.keda_webhook`: a ScaledObject is refused with a 403 while another HPA scales the
same target); the tests that need it, or kmock's request log, are kmock only. No garbage
collector runs: nothing here depends on one.
"""

from __future__ import annotations

import time

from kmock_harness import (
    CORE_RESOURCES,
    POD_MONITORS,
    SCALED_OBJECTS,
    Cluster,
    condition,
    keda_webhook,
    kmock_only,
)

from kvpark.operator import crd

KMOCK_RESOURCES = [*CORE_RESOURCES, POD_MONITORS, SCALED_OBJECTS]
KMOCK_ADMISSION = [keda_webhook]


def ours(cluster: Cluster, method: str, plural: str, ns: str) -> list:
    """Requests the operator's kube.py made (kmock's log; none to read on a real cluster)."""
    if cluster.server is None:
        return []
    return [r for r in cluster.server.requests() if r.method == method and r.resource
            and r.resource.plural == plural and r.namespace == ns
            and r.headers.get("User-Agent", "").startswith("kvpark-operator/")]


def events(cluster: Cluster, ns: str, reason: str) -> list[dict]:
    listing = cluster.api.get(f"/api/v1/namespaces/{ns}/events") or {}
    return [e for e in listing.get("items", []) if e.get("reason") == reason]


def create(cluster: Cluster, kind: str, ns: str, body: dict) -> dict:
    return cluster.api.create(cluster.path(kind, ns), body)


def team_hpa(name: str, target: str) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "labels": {"team": "a"}},
            "spec": {"scaleTargetRef": {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                        "name": target}, "maxReplicas": 9}}


def test_a_team_hpa_of_the_same_name_is_not_deleted(cluster: Cluster, ns: str) -> None:
    """Defect 1: creating PreemptServer `chat` deleted a team's HPA `chat`."""
    hpa = create(cluster, "HorizontalPodAutoscaler", ns, team_hpa("chat", "web"))
    cluster.create_server(ns, "chat", {})  # no autoscaling: it wants no HPA
    cluster.wait_child("PreemptServer", ns, "chat", lambda s: "status" in s)
    time.sleep(2.5)  # two more reconciles (KVPARK_RECONCILE_SECONDS=1)
    kept = cluster.get("HorizontalPodAutoscaler", ns, "chat")  # a real HPA controller adds status
    assert (kept["metadata"]["uid"], kept["spec"]) == (hpa["metadata"]["uid"], hpa["spec"])
    assert "ownerReferences" not in kept["metadata"]
    assert ours(cluster, "DELETE", "horizontalpodautoscalers", ns) == []


def test_a_team_service_of_the_same_name_is_not_adopted(cluster: Cluster, ns: str) -> None:
    """Defect 1: a team's Service got our owner reference and selector (and so would have been
    garbage-collected with the PreemptServer). Now: left alone, Degraded NameConflict, one
    Warning Event; the rest is served; once the name is free the Service is made."""
    service = create(cluster, "Service", ns, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"},
        "spec": {"selector": {"app": "team"}, "ports": [{"port": 80}]}})
    cluster.create_server(ns, "s", {})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "NameConflict")
    assert "Service s already exists" in condition(server, "Degraded")["message"]
    assert "observedGeneration" not in server["status"]
    cluster.wait_child("Deployment", ns, "s")
    time.sleep(2.5)
    assert cluster.get("Service", ns, "s") == service
    assert ours(cluster, "PATCH", "services", ns) == []
    (event,) = events(cluster, ns, "NameConflict")  # one, not one per reconcile
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "s"
    cluster.delete("Service", ns, "s")
    made = cluster.wait_child("Service", ns, "s", lambda s: s["metadata"].get(
        "ownerReferences"))
    assert made["metadata"]["ownerReferences"][0]["uid"] == server["metadata"]["uid"]
    server = cluster.wait_condition(ns, "s", "Degraded", "False", "AsExpected")
    assert server["status"]["observedGeneration"] == server["metadata"]["generation"]


def test_switching_hpa_to_keda_and_back_passes_keda_admission(cluster: Cluster, ns: str
                                                              ) -> None:
    """Defect 2: the ScaledObject was applied before the HPA was deleted, and the (emulated)
    KEDA webhook refused it forever. Now the old autoscaler goes first, both ways."""
    cluster.create_server(ns, "s", {"autoscaling": {"maxReplicas": 3}})
    cluster.wait_child("HorizontalPodAutoscaler", ns, "s")
    cluster.patch_spec(ns, "s", {"autoscaling": {"engine": "keda"}})
    cluster.wait_child("ScaledObject", ns, "s")
    assert cluster.get("HorizontalPodAutoscaler", ns, "s") is None
    server = cluster.wait_child("PreemptServer", ns, "s", lambda s: s.get(
        "status", {}).get("observedGeneration") == s["metadata"]["generation"])
    assert condition(server, "Degraded")["status"] == "False"
    cluster.patch_spec(ns, "s", {"autoscaling": {"engine": "hpa"}})
    cluster.wait_child("HorizontalPodAutoscaler", ns, "s")
    cluster.wait_gone("ScaledObject", ns, "s")
    assert events(cluster, ns, "ApiError") == []


def test_a_refusal_by_a_webhook_is_degraded_with_its_message(cluster: Cluster) -> None:
    """Defect 2: a 403 (here the emulated KEDA webhook, because a team's HPA scales the
    PreemptServer) reaches Degraded with the API server's message, once as an Event, and
    observedGeneration stays at the last generation applied."""
    kmock_only(cluster, "the webhook is kmock's (keda_webhook)")
    cluster.create_server("refused", "s", {})
    first = cluster.wait_child("PreemptServer", "refused", "s", lambda s: s.get(
        "status", {}).get("observedGeneration") == 1)
    create(cluster, "HorizontalPodAutoscaler", "refused", team_hpa("team", "s"))
    cluster.patch_spec("refused", "s", {"autoscaling": {"engine": "keda", "maxReplicas": 2}})
    server = cluster.wait_condition("refused", "s", "Degraded", "True", "ApiError")
    message = condition(server, "Degraded")["message"]
    assert "403" in message and "already managed by the hpa 'team'" in message
    assert server["metadata"]["generation"] == 2
    assert server["status"]["observedGeneration"] == 1
    time.sleep(2.5)
    assert len(events(cluster, "refused", "ApiError")) == 1
    assert first["metadata"]["uid"] == server["metadata"]["uid"]
    cluster.delete("HorizontalPodAutoscaler", "refused", "team")
    cluster.wait_child("ScaledObject", "refused", "s")
    server = cluster.wait_condition("refused", "s", "Degraded", "False")
    assert server["status"]["observedGeneration"] == 2


def test_the_deployment_watch_is_filtered_by_the_api_server(cluster: Cluster) -> None:
    """Defect 8: the Deployment watch was cluster-wide, filtered client-side. (kmock does not
    filter by label: this checks what the operator asks for.)"""
    kmock_only(cluster, "it reads kmock's request log")
    deployments = [r for r in cluster.server.requests() if r.resource
                   and r.resource.plural == "deployments" and r.method == "GET"
                   and r.headers.get("User-Agent", "").startswith("kopf/")]
    assert deployments
    for request in deployments:
        assert request.params.get("labelSelector") == "app.kubernetes.io/managed-by=kvpark-operator"


def test_a_steady_state_only_reads_what_it_serves(cluster: Cluster) -> None:
    """Defect 8: each interval made 9 calls per PreemptServer, 3 of them DELETEs that always
    answered 404, plus discovery. Now a reconcile with nothing to change reads the children it
    has (one GET each) and writes nothing."""
    kmock_only(cluster, "it reads kmock's request log and writes the Deployment's status")
    cluster.create_server("steady", "s", {"autoscaling": {"maxReplicas": 2}})
    deployment = cluster.wait_child("Deployment", "steady", "s")
    cluster.set_deployment_status("steady", "s", observedGeneration=deployment["metadata"][
        "generation"], replicas=1, updatedReplicas=1, readyReplicas=1, availableReplicas=1)
    cluster.wait_condition("steady", "s", "Ready", "True", "AllReplicasReady")
    time.sleep(1.5)  # let the last write's events settle
    start = len(cluster.server.requests())
    time.sleep(3.2)  # three resync rounds (KVPARK_RECONCILE_SECONDS=1)
    calls = [r for r in cluster.server.requests()[start:]
             if r.headers.get("User-Agent", "").startswith("kvpark-operator/")
             and (r.namespace == "steady" or not r.namespace)]
    assert [r for r in calls if r.method != "GET"] == []
    paths = {r.url.path for r in calls}
    assert paths == {cluster.path(kind, "steady", "s") for kind in (
        "Deployment", "Service", "HorizontalPodAutoscaler", "PodMonitor")}
    assert 4 <= len(calls) <= 5 * 4  # at least one round; rounds slow down on a busy machine
