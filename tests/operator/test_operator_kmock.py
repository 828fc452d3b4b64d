"""The operator end to end: real kopf (KopfRunner) and the real `kubernetes` client talk HTTP to
kmock on 127.0.0.1 and, with $KUBECONFIG (marker `cluster`), to that real API server: the
`cluster` fixture (conftest.py) runs each test on both. kmock is an emulator, not kube-apiserver:
no Deployment controller, no garbage collector, no defaulting, no validation, no RBAC, and
server-side apply acts as a merge patch; the tests that write status in a controller's place are
kmock only. What only a real cluster can show is in test_operator_cluster.py.
"""

from __future__ import annotations

import time

from kmock_harness import (
    CORE_RESOURCES,
    POD_MONITORS,
    SCALED_OBJECTS,
    Cluster,
    condition,
    kmock_only,
    wait_for,
)

from kvpark.operator import crd

CHILDREN = ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "PodMonitor"]


KMOCK_RESOURCES = [*CORE_RESOURCES, POD_MONITORS, SCALED_OBJECTS]


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def flag(deployment: dict, name: str) -> str:
    args = container(deployment)["args"]
    return args[args.index(name) + 1]


def test_create_makes_owned_children_with_the_flags(cluster: Cluster, ns: str) -> None:
    server = cluster.create_server(ns, "s", {
        "replicas": 2, "parallel": 8, "contextSize": 16384, "preempt": {"ramMiB": 2048},
        "autoscaling": {"maxReplicas": 4, "target": {"signal": "kvUsage"}},
    })
    uid = server["metadata"]["uid"]
    for kind in CHILDREN:
        child = cluster.wait_child(kind, ns, "s")
        owners = child["metadata"]["ownerReferences"]
        assert owners == [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": "s",
                           "uid": uid, "controller": True, "blockOwnerDeletion": True}], kind
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "s"
    deployment = cluster.get("Deployment", ns, "s")
    assert deployment["spec"]["replicas"] == 2
    assert (flag(deployment, "--parallel"), flag(deployment, "--ctx-size")) == ("8", "16384")
    assert flag(deployment, "--preempt-ram") == "2048"
    assert "--preempt" in container(deployment)["args"]
    env = {e["name"]: e for e in container(deployment)["env"]}
    assert env["KVPARK_MEMORY_LIMIT"]["valueFrom"]["resourceFieldRef"]["resource"] == \
        "limits.memory"
    hpa = cluster.get("HorizontalPodAutoscaler", ns, "s")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                             "name": "s"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "kvpark_kv_cache_usage_ratio"
    service = cluster.get("Service", ns, "s")
    assert service["spec"]["ports"][0]["name"] == "http"


def test_spec_change_patches_the_deployment_in_place(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {"parallel": 4})
    before = cluster.wait_child("Deployment", ns, "s")
    cluster.patch_spec(ns, "s", {"parallel": 12, "preempt": {"enabled": False},
                                       "resources": {"gpus": 0, "cpu": "3"}})
    after = cluster.wait_child("Deployment", ns, "s",
                               lambda d: flag(d, "--parallel") == "12")
    args = container(after)["args"]
    assert "--no-preempt" in args and "--preempt-ram" not in args
    assert flag(after, "--threads") == "3"
    assert "nvidia.com/gpu" not in container(after)["resources"]["limits"]
    # the same object, patched: never deleted and created again
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    if cluster.server:  # kmock's log: the uid above is what a real cluster shows of it
        deletes = [r for r in cluster.server.requests() if r.method == "DELETE"
                   and r.resource.plural == "deployments" and r.namespace == ns]
        assert deletes == []
    cluster.wait_child("PreemptServer", ns, "s",
                       lambda s: s.get("status", {}).get("preemptRamMiB") == 0)


def test_status_and_ready_follow_the_deployment(cluster: Cluster) -> None:
    kmock_only(cluster, "it writes the Deployment's status, which a real Deployment controller "
               "owns and would overwrite")
    cluster.create_server("status", "s", {"replicas": 2})
    deployment = cluster.wait_child("Deployment", "status", "s")
    server = cluster.wait_condition("status", "s", "Ready", "False", "ReplicasNotReady")
    assert server["status"]["selector"] == \
        "app.kubernetes.io/instance=s,app.kubernetes.io/name=kvpark-server"
    assert server["status"]["endpoint"] == "http://s.status.svc:8080"
    assert server["status"]["observedGeneration"] == server["metadata"]["generation"]
    not_ready_since = condition(server, "Ready")["lastTransitionTime"]

    generation = deployment["metadata"]["generation"]
    cluster.set_deployment_status("status", "s", observedGeneration=generation, replicas=2,
                                  updatedReplicas=2, readyReplicas=2, availableReplicas=2)
    server = cluster.wait_condition("status", "s", "Ready", "True", "AllReplicasReady")
    assert server["status"]["readyReplicas"] == 2 and server["status"]["replicas"] == 2
    assert condition(server, "Progressing")["status"] == "False"
    assert condition(server, "Degraded")["reason"] == "AsExpected"
    assert condition(server, "Ready")["lastTransitionTime"] >= not_ready_since

    # Defect 9: one pod of two serving is Ready (the endpoint answers), and Progressing
    cluster.set_deployment_status("status", "s", readyReplicas=1, availableReplicas=1)
    server = cluster.wait_condition("status", "s", "Ready", "True", "MinimumReplicasReady")
    assert server["status"]["readyReplicas"] == 1
    assert "1/2" in condition(server, "Ready")["message"]
    assert condition(server, "Progressing")["status"] == "True"
    cluster.set_deployment_status("status", "s", readyReplicas=0, availableReplicas=0)
    cluster.wait_condition("status", "s", "Ready", "False", "ReplicasNotReady")


def test_children_deleted_by_hand_come_back(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {"replicas": 2})
    old = cluster.wait_child("Deployment", ns, "s")
    cluster.wait_child("Service", ns, "s")
    cluster.wait_child("PodDisruptionBudget", ns, "s")
    cluster.delete("Deployment", ns, "s")  # the Deployment watch notices
    new = cluster.wait_child("Deployment", ns, "s",
                             lambda d: d["metadata"]["uid"] != old["metadata"]["uid"])
    assert new["spec"]["replicas"] == 2
    cluster.delete("Service", ns, "s")  # the timer notices
    cluster.delete("PodDisruptionBudget", ns, "s")
    cluster.wait_child("Service", ns, "s")
    cluster.wait_child("PodDisruptionBudget", ns, "s")


def test_scale_subresource_and_pdb(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {"replicas": 1})
    cluster.wait_child("Deployment", ns, "s")
    assert cluster.get("PodDisruptionBudget", ns, "s") is None
    cluster.scale(ns, "s", 3)  # what `kubectl scale ps/s --replicas=3` and an HPA do
    cluster.wait_child("Deployment", ns, "s", lambda d: d["spec"]["replicas"] == 3)
    cluster.wait_child("PodDisruptionBudget", ns, "s")
    cluster.scale(ns, "s", 1)
    cluster.wait_child("Deployment", ns, "s", lambda d: d["spec"]["replicas"] == 1)
    cluster.wait_gone("PodDisruptionBudget", ns, "s")


def test_autoscaler_follows_the_engine(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {"autoscaling": {"maxReplicas": 3}})
    cluster.wait_child("HorizontalPodAutoscaler", ns, "s")
    cluster.patch_spec(ns, "s", {"autoscaling": {
        "engine": "keda", "target": {"signal": "preemptRate", "averageValue": "250m"}}})
    scaled = cluster.wait_child("ScaledObject", ns, "s")
    cluster.wait_gone("HorizontalPodAutoscaler", ns, "s")
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == \
        f'sum(rate(kvpark:n_preempt_total{{namespace="{ns}",app_kubernetes_io_instance="s"}}[2m]))'
    assert trigger["metadata"]["threshold"] == "0.25"
    assert scaled["spec"]["scaleTargetRef"]["kind"] == crd.KIND
    cluster.patch_spec(ns, "s", {"autoscaling": None})
    cluster.wait_gone("ScaledObject", ns, "s")
    assert cluster.get("HorizontalPodAutoscaler", ns, "s") is None


def test_spec_only_the_operator_can_reject_is_degraded(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {"server": {"args": ["--api-key=hunter2"]}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "ReservedArgument")
    assert "--api-key" in condition(server, "Degraded")["message"]
    assert cluster.get("Deployment", ns, "s") is None  # nothing half-applied
    cluster.patch_spec(ns, "s", {"server": {"args": ["--max-queue", "64"]}})
    cluster.wait_condition(ns, "s", "Degraded", "False", "AsExpected")
    deployment = cluster.wait_child("Deployment", ns, "s")
    assert container(deployment)["args"][-2:] == ["--max-queue", "64"]


def test_no_finalizer_is_added_and_an_old_one_is_taken_off(cluster: Cluster, ns: str) -> None:
    """Defect 3: kopf's timer added kopf.zalando.org/KopfFinalizerMarker, so a PreemptServer
    (and its namespace) could not be deleted once the operator was uninstalled."""
    cluster.create_server(ns, "s", {})
    cluster.wait_child("PreemptServer", ns, "s", lambda s: "status" in s)
    time.sleep(2.5)  # two resync rounds (KVPARK_RECONCILE_SECONDS=1)
    assert not cluster.get("PreemptServer", ns, "s")["metadata"].get("finalizers")
    # one made by an older operator: kopf drops a finalizer that no handler needs
    cluster.api.create(cluster.path("PreemptServer", ns), {
        "apiVersion": crd.API_VERSION, "kind": crd.KIND, "spec": {}, "metadata": {
            "name": "old", "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]}})
    cluster.wait_child("PreemptServer", ns, "old",
                       lambda s: not s["metadata"].get("finalizers"))


def test_abbreviated_reserved_flags_are_degraded(cluster: Cluster, ns: str) -> None:
    """Defect 4: `--ctx 262144` and friends passed as if they were harmless extra flags."""
    cluster.create_server(ns, "s", {"server": {"args": [
        "--ctx", "262144", "--par=64", "-c4096", "--preempt-ra=-1", "--shut", "9999"]}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "ReservedArgument")
    message = condition(server, "Degraded")["message"]
    assert "--ctx-size" in message and "--preempt-ra=-1" in message
    assert cluster.get("Deployment", ns, "s") is None


def test_pod_monitor_carries_the_labels_prometheus_selects(cluster: Cluster, ns: str) -> None:
    """Defect 6: without `release: <name>` kube-prometheus-stack never scraped the pods."""
    cluster.create_server(ns, "s", {"monitoring": {"podMonitorLabels": {
        "release": "kube-prometheus-stack"}}})
    monitor = cluster.wait_child("PodMonitor", ns, "s")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    cluster.patch_spec(ns, "s", {"monitoring": {"podMonitorLabels": {"release": "prom"}}})
    cluster.wait_child("PodMonitor", ns, "s",
                       lambda m: m["metadata"]["labels"]["release"] == "prom")


def test_rollout_strategy_is_configurable(cluster: Cluster, ns: str) -> None:
    """Defect 10: maxSurge 1 stalls a rollout when no GPU is free for the extra pod."""
    cluster.create_server(ns, "s", {})
    deployment = cluster.wait_child("Deployment", ns, "s")
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    cluster.patch_spec(ns, "s", {"strategy": {"maxSurge": 0, "maxUnavailable": 1}})
    cluster.wait_child("Deployment", ns, "s", lambda d: d["spec"]["strategy"][
        "rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1})


def test_pod_failures_reach_status_and_events_within_an_interval(cluster: Cluster) -> None:
    """Defect 9: an unschedulable pod (no GPU free) and an image that cannot be pulled showed
    nowhere until the Deployment's progressDeadlineSeconds (1800 s). kmock runs no scheduler
    or kubelet: the test writes the pods' status as they would."""
    kmock_only(cluster, "a real API server ignores the status of a pod being created")
    from kvpark.operator import metadata

    cluster.create_server("pods", "s", {"replicas": 2})
    cluster.wait_child("Deployment", "pods", "s")
    labels = metadata.get_labels("s")
    for name, status in [
        ("s-1", {"conditions": [{"type": "PodScheduled", "status": "False",
                                 "reason": "Unschedulable", "message": "0/3 nodes are "
                                 "available: 3 Insufficient nvidia.com/gpu."}]}),
        ("s-2", {"containerStatuses": [{"name": "server", "ready": False, "state": {
            "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}}}]}),
    ]:
        cluster.api.create("/api/v1/namespaces/pods/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "server", "image": "x"}]}, "status": status})
    server = cluster.wait_child("PreemptServer", "pods", "s", lambda s: "ImagePullBackOff" in
                                str(s.get("status")), timeout=5)
    degraded = condition(server, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in degraded["message"]
    assert condition(server, "Progressing")["status"] == "False"
    def reasons() -> set[str]:
        listing = cluster.api.get("/api/v1/namespaces/pods/events") or {}
        return {e["reason"] for e in listing.get("items", []) if e.get("type") == "Warning"}
    wait_for("the Events", lambda: {"Unschedulable", "ImagePullBackOff"} <= reasons(), 5)
    deployment = cluster.get("Deployment", "pods", "s")
    cluster.set_deployment_status("pods", "s", observedGeneration=deployment["metadata"][
        "generation"], replicas=2, updatedReplicas=2, readyReplicas=2, availableReplicas=2)
    cluster.wait_condition("pods", "s", "Degraded", "False", "AsExpected")
