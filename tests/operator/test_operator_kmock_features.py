"""The platform features end to end against kmock and, with $KUBECONFIG, a real API server (the
`cluster` fixture, conftest.py): a pod template patch, a refused override, the model-cache claim
and the InferencePool (a stand-in CRD on a real cluster without the Gateway API Inference
Extension), the KV disk tier's volumes. kmock treats server-side apply as a merge patch and
validates nothing."""

from __future__ import annotations

from kmock_harness import CORE_RESOURCES, INFERENCE_POOLS, Cluster, condition

from kvpark.operator import builders

POD_TEMPLATE = {"metadata": {"annotations": {"team": "ml"}},
                "spec": {"priorityClassName": "inference-high",
                         "containers": [{"name": "server",
                                         "env": [{"name": "EXTRA", "value": "1"}]}]}}


KMOCK_RESOURCES = [*CORE_RESOURCES, INFERENCE_POOLS]


def test_pod_template_and_a_refused_override(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {"podTemplate": POD_TEMPLATE})
    deployment = cluster.wait_child("Deployment", ns, "s")
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["team"] == "ml"
    assert template["spec"]["priorityClassName"] == "inference-high"
    env = [e["name"] for e in template["spec"]["containers"][0]["env"]]
    assert env[0] == "KVPARK_MEMORY_LIMIT" and env[-1] == "EXTRA"
    cluster.patch_spec(ns, "s", {"podTemplate": {"spec": {"containers": [
        {"name": "server", "image": "evil:1", "env": [{"name": "EXTRA", "value": "1"}]}]}}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "OwnedField")
    assert "spec.containers[server].image" in condition(server, "Degraded")["message"]
    image = cluster.get("Deployment", ns, "s")["spec"]["template"]["spec"]["containers"][0][
        "image"]
    assert image != "evil:1"  # nothing applied


def test_cache_claim_and_inference_pool(cluster: Cluster, ns: str) -> None:
    cluster.create_server(ns, "s", {
        "model": {"uri": "hf://O/R", "revision": "main", "sizeMiB": 100,
                  "cache": {"pvc": {"size": "20Gi", "storageClassName": "nfs"}}},
        "routing": {"inferencePool": {"endpointPicker": {"name": "epp"}}}})
    pvc = cluster.wait_child("PersistentVolumeClaim", ns, "s")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    deployment = cluster.wait_child("Deployment", ns, "s")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "s"}} in volumes
    pool = cluster.wait_child("InferencePool", ns, "s")
    assert pool["spec"]["endpointPickerRef"]["name"] == "epp"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == pvc["metadata"]["ownerReferences"][
        0]["uid"]
    cluster.patch_spec(ns, "s", {"routing": None,
                                     "model": {"cache": {"pvc": {"size": None,
                                                                 "storageClassName": None,
                                                                 "claimName": "shared"}}}})
    cluster.wait_gone("InferencePool", ns, "s")
    cluster.wait_gone("PersistentVolumeClaim", ns, "s")  # ours, no longer wanted
    deployment = cluster.wait_child("Deployment", ns, "s", lambda d: {
        "name": "model", "persistentVolumeClaim": {"claimName": "shared"}} in d["spec"][
        "template"]["spec"]["volumes"])


def test_kv_events_for_the_precise_prefix_scorer(cluster: Cluster, ns: str) -> None:
    """routing.inferencePool.kvEvents: the server publishes (its args, the pod IP, the port,
    the engine-type label) and the picker's config is a ConfigMap; a flag set by hand beside
    it is refused; without it the ConfigMap goes."""
    cluster.create_server(ns, "s", {"routing": {"inferencePool": {
        "endpointPicker": {"name": "epp"}, "kvEvents": {"modelName": "Qwen/Qwen3.5-4B"}}}})
    deployment = cluster.wait_child("Deployment", ns, "s")
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    assert template["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    config = container["args"][container["args"].index("--kv-events-config") + 1]
    assert '"topic":"kv@$(POD_IP)@Qwen/Qwen3.5-4B"' in config
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {
        "apiVersion": "v1", "fieldPath": "status.podIP"}}} in container["env"] or {
        "name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in \
        container["env"]  # a real API server writes the fieldRef's default apiVersion
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in container["ports"]
    picker = cluster.wait_child("ConfigMap", ns, "s")
    assert "precise-prefix-cache-scorer" in picker["data"]["precise-prefix-cache-config.yaml"]
    cluster.patch_spec(ns, "s", {"server": {"args": ["--kv-events-config", "{}"]}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "ReservedArgument")
    assert "--kv-events-config" in condition(server, "Degraded")["message"]
    cluster.patch_spec(ns, "s", {"server": {"args": None},
                                 "routing": {"inferencePool": {"kvEvents": None}}})
    cluster.wait_gone("ConfigMap", ns, "s")


def kv_volume(deployment: dict) -> dict | None:
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    return next((v for v in volumes if v["name"] == "kv-cache"), None)


def test_kv_cache_disk_shared_then_per_pod_then_none(cluster: Cluster, ns: str) -> None:
    """Issue 42: shared: one ReadWriteMany claim of ours that every pod mounts; per pod: a
    generic ephemeral volume (our claim goes); no disk: no flags, no volume, the grace period
    back to the drain's."""
    server = cluster.create_server(ns, "s", {"replicas": 2, "kvCache": {"disk": {
        "size": "20Gi", "storageClassName": "nfs", "shared": True, "writeOutSeconds": 30}}})
    claim = cluster.wait_child("PersistentVolumeClaim", ns, "s-kv-cache")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert claim["spec"]["storageClassName"] == "nfs"
    owner = claim["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "PreemptServer", server["metadata"]["uid"], True)
    assert claim["metadata"]["labels"]["app.kubernetes.io/instance"] == "s"
    deployment = cluster.wait_child("Deployment", ns, "s")
    pod = deployment["spec"]["template"]["spec"]
    assert kv_volume(deployment) == {"name": "kv-cache",
                                     "persistentVolumeClaim": {"claimName": "s-kv-cache"}}
    assert {"name": "kv-cache", "mountPath": "/var/cache/kvpark/kv"} in \
        pod["containers"][0]["volumeMounts"]
    args = pod["containers"][0]["args"]
    start = args.index("--cache-disk")
    assert args[start:start + 6] == ["--cache-disk", "/var/cache/kvpark/kv",
                                     "--cache-disk-size", "19.00", "--cache-disk-write-out", "30"]
    drain = builders.PRESTOP_SECONDS + 120 + builders.GRACE_MARGIN_SECONDS
    assert pod["terminationGracePeriodSeconds"] == drain + 30
    assert pod["securityContext"]["fsGroup"] == 10001

    cluster.patch_spec(ns, "s", {"kvCache": {"disk": {"shared": False}}})
    cluster.wait_gone("PersistentVolumeClaim", ns, "s-kv-cache")  # ours, no longer wanted
    deployment = cluster.wait_child("Deployment", ns, "s",
                                    lambda d: "ephemeral" in (kv_volume(d) or {}))
    template = kv_volume(deployment)["ephemeral"]["volumeClaimTemplate"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert template["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert template["spec"]["storageClassName"] == "nfs"

    cluster.patch_spec(ns, "s", {"kvCache": None})
    deployment = cluster.wait_child("Deployment", ns, "s", lambda d: kv_volume(d) is None)
    pod = deployment["spec"]["template"]["spec"]
    assert not [a for a in pod["containers"][0]["args"] if a.startswith("--cache-disk")]
    assert "/var/cache/kvpark/kv" not in [m["mountPath"]
                                          for m in pod["containers"][0]["volumeMounts"]]
    assert pod["terminationGracePeriodSeconds"] == drain
    server = cluster.wait_condition(ns, "s", "Degraded", "False")
    assert cluster.get("PersistentVolumeClaim", ns, "s-kv-cache") is None


def test_a_kv_cache_disk_too_small_is_degraded(cluster: Cluster, ns: str) -> None:
    """The CRD takes any size above 0; the operator refuses one whose 95% rounds to 0 GiB (the
    server would exit on --cache-disk-size 0.00) and applies nothing."""
    cluster.create_server(ns, "s", {"kvCache": {"disk": {"size": "10Mi", "shared": True}}})
    server = cluster.wait_condition(ns, "s", "Degraded", "True", "KvCacheDiskTooSmall")
    assert "10Mi" in condition(server, "Degraded")["message"]
    assert cluster.get("Deployment", ns, "s") is None
    assert cluster.get("PersistentVolumeClaim", ns, "s-kv-cache") is None
