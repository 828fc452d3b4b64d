"""Pure builders: a PreemptServer -> its children, as plain dicts (no API involved)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import kubernetes_validate.utils as kv
import pytest

from kvpark.operator import autoscaling, builders, crd, metadata, sizing
from kvpark.operator.config import OperatorConfig
from kvpark.operator.security import UID as SERVER_UID

CONFIG = OperatorConfig(image="registry.example/kvpark:1.2.3")
SERVED = {autoscaling.POD_MONITORS, autoscaling.SCALED_OBJECTS}
UID = "4f9c2a6e-0000-4000-8000-000000000001"


def make_body(spec: dict[str, Any] | None = None, name: str = "llm", ns: str = "team") -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": ns, "uid": UID, "generation": 1},
            "spec": spec or {}}


def build(spec: dict[str, Any] | None = None, served=SERVED, config=CONFIG):
    body = make_body(spec)
    full = crd.get_spec(body)
    plan = sizing.get_sizing(full)
    return body, full, plan, builders.get_children(body, full, plan, config, served)


def deployment_of(spec: dict[str, Any] | None = None) -> dict:
    _, _, _, children = build(spec)
    return next(c for c in children.apply if c["kind"] == "Deployment")


def server_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def arg(container: dict, flag: str) -> str:
    return container["args"][container["args"].index(flag) + 1]


def test_flags_come_from_the_spec() -> None:
    container = server_container(deployment_of(
        {"parallel": 6, "contextSize": 12288, "pageSize": 32, "preempt": {"ramMiB": 3000},
         "server": {"args": ["--max-queue", "32"], "shutdownTimeoutSeconds": 90}}))
    assert container["command"] == ["kvpark-server"]
    assert (arg(container, "--host"), arg(container, "--port")) == ("0.0.0.0", "8080")
    assert arg(container, "--model") == "builtin://smollm2-135m"
    assert arg(container, "--parallel") == "6"
    assert arg(container, "--ctx-size") == "12288"
    assert arg(container, "--page-size") == "32"
    assert arg(container, "--preempt-ram") == "3000"
    assert arg(container, "--shutdown-timeout") == "90"
    assert "--preempt" in container["args"] and "--no-preempt" not in container["args"]
    assert container["args"][-2:] == ["--max-queue", "32"]  # the user's extra args come last
    assert container["image"] == CONFIG.image


def test_preempt_disabled_says_no_preempt() -> None:
    args = server_container(deployment_of({"preempt": {"enabled": False}}))["args"]
    assert "--no-preempt" in args and "--preempt" not in args and "--preempt-ram" not in args


def test_memory_limit_reaches_the_pod_through_the_downward_api() -> None:
    container = server_container(deployment_of())
    env = {e["name"]: e for e in container["env"]}
    assert env["KVPARK_MEMORY_LIMIT"]["valueFrom"] == {"resourceFieldRef": {
        "containerName": "server", "resource": "limits.memory", "divisor": "1"}}
    assert container["name"] == "server"


def test_api_key_comes_from_the_secret_and_never_from_a_flag() -> None:
    container = server_container(deployment_of(
        {"server": {"apiKeySecretRef": {"name": "keys"}}}))
    env = {e["name"]: e for e in container["env"]}
    assert env["KVPARK_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "keys",
                                                                  "key": "api-key"}}
    assert not any(a.startswith("--api-key") for a in container["args"])


def test_probes_hit_health_on_the_http_port() -> None:
    container = server_container(deployment_of())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    # the model may take minutes to load before /health turns 200
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_shm_is_a_memory_emptydir_counted_in_the_limit() -> None:
    _, _, plan, children = build()
    pod = children.apply[0]["spec"]["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{plan.shm_mib}Mi"}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/dev/shm"] == "shm"
    limit = sizing.to_mib(pod["containers"][0]["resources"]["limits"]["memory"])
    weights_mib = sizing.KNOWN_MODELS["builtin://smollm2-135m"].params * 4 / sizing.MIB
    assert limit >= plan.shm_mib + weights_mib + plan.preempt_ram + sizing.RUNTIME_MIB_GPU


def test_gpu_and_memory_resources() -> None:
    resources = server_container(deployment_of({"resources": {"gpus": 2}}))["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "2"
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    cpu = deployment_of({"resources": {"gpus": 0, "cpu": "2500m", "memory": "6Gi"}})
    container = server_container(cpu)
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["resources"]["limits"]["memory"] == "6Gi"
    assert container["resources"]["requests"]["cpu"] == "2500m"
    assert arg(container, "--threads") == "3"  # the CPU request, rounded up
    assert arg(container, "--kernel-threads") == "3"
    big = server_container(deployment_of({"resources": {"gpus": 0, "cpu": "600"}}))
    assert (arg(big, "--threads"), arg(big, "--kernel-threads")) == ("512", "64")
    tolerations = cpu["spec"]["template"]["spec"]["tolerations"]
    assert all(t.get("key") != "nvidia.com/gpu" for t in tolerations)


def test_pod_runs_unprivileged_with_a_read_only_root() -> None:
    pod = deployment_of()["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == SERVER_UID != 0
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False  # KVPARK_PORT=tcp://... would become --port
    for container in pod["containers"] + pod["initContainers"]:
        security = container["securityContext"]
        assert security == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert "/tmp" in mounts  # the only writable place, with HOME and the caches in it


def test_image_settings() -> None:
    pod = deployment_of({"image": "mine/kvpark:2", "imagePullPolicy": "Always",
                         "imagePullSecrets": [{"name": "registry"}]})["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert (pod["containers"][0]["image"], pod["containers"][0]["imagePullPolicy"]) == \
        ("mine/kvpark:2", "Always")


def test_hf_download_room() -> None:
    """Defect 10: the hf:// emptyDir had no sizeLimit and the pod no ephemeral-storage request."""
    def room(model: dict) -> tuple[dict, str]:
        pod = deployment_of({"model": {"uri": "hf://O/R", "defaultBranch": True, **model},
                             "resources": {"memory": "8Gi"}})["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        return volume["emptyDir"], pod["containers"][0]["resources"]["requests"][
            "ephemeral-storage"]
    assert room({"downloadSize": "20Gi"}) == ({"sizeLimit": "20Gi"}, "22528Mi")
    assert room({}) == ({"sizeLimit": crd.DEFAULT_DOWNLOAD_SIZE}, "67584Mi")
    builtin = server_container(deployment_of())
    assert "ephemeral-storage" not in builtin["resources"]["requests"]


def test_rollout_strategy_follows_the_spec() -> None:
    """Defect 10: the rollout was fixed at maxSurge 1 / maxUnavailable 0, which stalls when no
    GPU is free for the surge pod."""
    def strategy(value: dict) -> dict:
        return deployment_of({"strategy": value})["spec"]["strategy"]
    assert strategy({"maxSurge": 0, "maxUnavailable": 1}) == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    assert strategy({"maxUnavailable": "25%"})["rollingUpdate"] == {
        "maxUnavailable": "25%", "maxSurge": 1}
    assert strategy({"type": "Recreate"}) == {"type": "Recreate"}


def test_rollout_and_drain_settings() -> None:
    deployment = deployment_of({"server": {"shutdownTimeoutSeconds": 200}})
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = deployment["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["sleep", str(builders.PRESTOP_SECONDS)]
    # preStop, then the server's own drain, must both fit in the grace period
    assert pod["terminationGracePeriodSeconds"] > builders.PRESTOP_SECONDS + 200


@pytest.mark.parametrize("uri, flag, volume", [
    ("builtin://smollm2-135m", "builtin://smollm2-135m", None),
    ("file:///opt/models/tiny.gguf", "/opt/models/tiny.gguf", None),
    ("pvc://weights/llama/q8.gguf", "/models/pvc/llama/q8.gguf",
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}),
    ("pvc://weights", "/models/pvc", {"name": "model", "persistentVolumeClaim": {
        "claimName": "weights", "readOnly": True}}),
])
def test_model_sources(uri: str, flag: str, volume: dict | None) -> None:
    spec = {"model": {"uri": uri, "sizeMiB": 100}}
    deployment = deployment_of(spec)
    assert arg(server_container(deployment), "--model") == flag
    volumes = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
               if v["name"] == "model"]
    assert volumes == ([volume] if volume else [])


def test_hf_model_is_downloaded_by_an_init_container() -> None:
    deployment = deployment_of({"model": {
        "uri": "hf://Org/Repo/sub/q4.gguf", "revision": "0123abcd", "sizeMiB": 800,
        "hfTokenSecretRef": {"name": "hf"}}})
    pod = deployment["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["command"] == ["hf", "download", "Org/Repo", "sub/q4.gguf", "--local-dir",
                                "/models/hf", "--revision", "0123abcd"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} \
        in fetch["env"]
    assert fetch["image"] == pod["containers"][0]["image"]
    assert arg(pod["containers"][0], "--model") == "/models/hf/sub/q4.gguf"
    # 800 MiB + 10% + 1 GiB: a download that outgrows it evicts the pod instead of the node
    assert {"name": "model", "emptyDir": {"sizeLimit": "1904Mi"}} in pod["volumes"]
    assert pod["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "3952Mi"
    default = deployment_of({"model": {"uri": "hf://Org/Repo", "defaultBranch": True,
                                       "sizeMiB": 800}})
    (fetch,) = default["spec"]["template"]["spec"]["initContainers"]
    assert "--revision" not in fetch["command"]


def test_every_child_is_owned_named_and_labelled() -> None:
    body, _, _, children = build({"replicas": 3, "autoscaling": {"maxReplicas": 5}})
    kinds = [c["kind"] for c in children.apply]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                     "PodMonitor"]
    for child in children.apply:
        meta = child["metadata"]
        assert (meta["name"], meta["namespace"]) == ("llm", "team")
        # blockOwnerDeletion: a foreground deletion of the PreemptServer waits for its children
        assert meta["ownerReferences"] == [{"apiVersion": "kvpark.io/v1alpha1",
                                            "kind": "PreemptServer", "name": "llm", "uid": UID,
                                            "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kvpark-operator"
    selector = metadata.get_selector_labels("llm")
    deployment, service, pdb = children.apply[:3]
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert metadata.get_selector("llm") == \
        "app.kubernetes.io/instance=llm,app.kubernetes.io/name=kvpark-server"


@pytest.mark.parametrize("signal, metric, value", [
    ("parkedRequests", "kvpark_requests_preempted", "1"),
    ("preemptRate", "kvpark_preempt_rate", "0.5"),
    ("kvUsage", "kvpark_kv_cache_usage_ratio", "0.8"),
])
def test_hpa_scales_the_preemptserver_on_the_signal(signal: str, metric: str, value: str) -> None:
    _, _, _, children = build({"autoscaling": {"minReplicas": 2, "maxReplicas": 6,
                                               "target": {"signal": signal}}})
    hpa = next(c for c in children.apply if c["kind"] == "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "kvpark.io/v1alpha1",
                                             "kind": "PreemptServer", "name": "llm"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": metric}, "target": {"type": "AverageValue", "averageValue": value}}}]
    assert ("keda.sh/v1alpha1", "ScaledObject", "llm") in children.delete


@pytest.mark.parametrize("signal, query", [
    ("parkedRequests", 'sum(kvpark:requests_preempted{namespace="team",'
                       'app_kubernetes_io_instance="llm"})'),
    ("preemptRate", 'sum(rate(kvpark:n_preempt_total{namespace="team",'
                    'app_kubernetes_io_instance="llm"}[2m]))'),
    ("kvUsage", 'sum(kvpark:kv_cache_usage_ratio{namespace="team",'
                'app_kubernetes_io_instance="llm"})'),
])
def test_keda_scaled_object_carries_the_promql(signal: str, query: str) -> None:
    _, _, _, children = build({"autoscaling": {
        "engine": "keda", "maxReplicas": 4, "target": {"signal": signal, "averageValue": "750m"},
        "prometheusAddress": "http://prom.monitoring:9090"}})
    scaled = next(c for c in children.apply if c["kind"] == "ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {"serverAddress": "http://prom.monitoring:9090",
                                   "query": query, "threshold": "0.75"}
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "PreemptServer"
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "llm") in children.delete
    # Defect 10: cooldownPeriod only acts on scaling to zero, and minReplicas >= 1; the
    # scale-down window is the HPA's, as with engine: hpa
    assert "cooldownPeriod" not in scaled["spec"]
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == {
        "scaleDown": {"stabilizationWindowSeconds": 300}}


def test_optional_children_follow_the_spec_and_the_cluster() -> None:
    _, _, _, one = build({"replicas": 1})
    assert [c["kind"] for c in one.apply] == ["Deployment", "Service", "PodMonitor"]
    assert ("policy/v1", "PodDisruptionBudget", "llm") in one.delete
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "llm") in one.delete
    _, _, _, bare = build({"autoscaling": {"engine": "keda", "maxReplicas": 2}}, served=set())
    assert [c["kind"] for c in bare.apply] == ["Deployment", "Service"]
    assert any("no PodMonitor" in n for n in bare.notes)
    # an API the cluster does not serve has nothing to delete either
    assert all(kind not in ("ScaledObject", "PodMonitor") for _, kind, _ in bare.delete)
    (problem,) = bare.problems
    assert (problem.reason, problem.blocking) == ("AutoscalerUnavailable", False)
    _, _, _, off = build({}, config=OperatorConfig(pod_monitor="false"))
    assert ("monitoring.coreos.com/v1", "PodMonitor", "llm") in off.delete


@pytest.mark.parametrize("server, offending", [
    ({"args": ["--parallel", "9"]}, "--parallel"),
    ({"args": ["-c", "100"]}, "--ctx-size"),
    ({"args": ["-c4096"]}, "--ctx-size"),
    ({"args": ["-np", "8"]}, "--parallel"),
    ({"args": ["--api-key=secret"]}, "--api-key"),
    ({"args": ["--preempt-ram=1"]}, "--preempt-ram"),
    ({"args": ["--no-preempt"]}, "--preempt"),
    ({"env": [{"name": "KVPARK_PARALLEL", "value": "9"}]}, "KVPARK_PARALLEL"),
    ({"env": [{"name": "KVPARK_MEMORY_LIMIT", "value": "1"}]}, "KVPARK_MEMORY_LIMIT"),
    ({"env": [{"name": "LLAMA_ARG_PREEMPT_RAM", "value": "1"}]}, "LLAMA_ARG_PREEMPT_RAM"),
])
def test_flags_the_operator_owns_are_refused(server: dict, offending: str) -> None:
    _, _, _, children = build({"server": server})
    (problem,) = children.problems
    assert problem.reason == "ReservedArgument" and problem.blocking
    assert offending in problem.message


def test_abbreviated_flags_are_refused() -> None:
    """Defect 4: argparse took `--ctx` for `--ctx-size`, so these passed the old check while the
    memory limit stayed sized for the spec's values."""
    args = ["--ctx", "262144", "--par=64", "-c4096", "--preempt-ra=-1", "--shut", "9999"]
    _, _, _, children = build({"server": {"args": args}})
    reserved, unknown = children.problems
    assert (reserved.reason, reserved.blocking) == ("ReservedArgument", True)
    assert "--ctx-size" in reserved.message  # -c4096
    assert (unknown.reason, unknown.blocking) == ("UnknownArgument", True)
    for token in ("--ctx", "--par=64", "--preempt-ra=-1", "--shut"):
        assert token in unknown.message
    (bad,) = build({"server": {"args": ["--max-queue", "lots"]}})[3].problems
    assert bad.reason == "InvalidArgument" and "--max-queue" in bad.message


def test_the_args_check_needs_no_torch() -> None:
    """The operator's image may have no torch: the server's parser comes without it."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from kvpark.operator import handlers, validation\n"
            "assert validation.get_args_problems(['--ctx', '1'])\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_harmless_extra_args_pass() -> None:
    _, _, _, children = build({"server": {"args": ["--max-queue", "9", "--threads=2",
                                                   "--attention-backend", "torch"],
                                          "env": [{"name": "KVPARK_MAX_QUEUE", "value": "4"}]}})
    assert children.problems == []


BUILTIN_KINDS = {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"}
SPECS = [
    {},
    {"replicas": 3, "resources": {"gpus": 0, "cpu": "4"}, "autoscaling": {"maxReplicas": 6}},
    {"model": {"uri": "hf://Qwen/Qwen3-4B", "revision": "main", "sizeMiB": 7680,
               "hfTokenSecretRef": {"name": "hf"}},
     "server": {"apiKeySecretRef": {"name": "k"}, "env": [
         {"name": "EXTRA", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
     "nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "x", "operator": "Exists"}],
     "imagePullSecrets": [{"name": "registry"}]},
    {"model": {"uri": "pvc://weights/m.gguf"}, "resources": {"memory": "24Gi"},
     "preempt": {"ramMiB": -1}, "strategy": {"maxSurge": 0, "maxUnavailable": "50%"}},
    {"model": {"uri": "hf://O/R", "defaultBranch": True, "downloadSize": "30Gi"},
     "resources": {"memory": "24Gi"}, "strategy": {"type": "Recreate"}},
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_children_pass_the_official_schemas(spec: dict, version: str) -> None:
    _, _, _, children = build(spec)
    # PodMonitor and ScaledObject belong to CRDs these schemas do not have
    builtin = [c for c in children.apply if c["kind"] in BUILTIN_KINDS]
    assert {c["kind"] for c in builtin} >= {"Deployment", "Service"}
    for child in builtin:
        kv.validate(child, version, strict=True)


def test_more_than_one_gpu_is_refused() -> None:
    """Defect 5: the server uses one device; the CRD caps gpus at 1 and the operator refuses
    more (a CRD installed before the cap lets it through), instead of allocating idle GPUs."""
    assert crd.get_openapi_schema()["properties"]["spec"]["properties"]["resources"][
        "properties"]["gpus"]["maximum"] == 1
    _, _, _, children = build({"resources": {"gpus": 4}})
    (problem,) = children.problems
    assert (problem.reason, problem.blocking) == ("TooManyGPUs", True)
    assert build({"resources": {"gpus": 1}})[3].problems == []


def test_pod_monitor_labels_come_from_the_operator_and_the_spec() -> None:
    """Defect 6: kube-prometheus-stack's Prometheus selects PodMonitors by `release`."""
    config = OperatorConfig(pod_monitor_labels=(("release", "kps"), ("team", "ops")))
    _, _, _, children = build({"monitoring": {"podMonitorLabels": {
        "team": "ml", "app.kubernetes.io/name": "mine"}}}, config=config)
    (monitor,) = [c for c in children.apply if c["kind"] == "PodMonitor"]
    labels = monitor["metadata"]["labels"]
    assert labels["release"] == "kps" and labels["team"] == "ml"  # the spec's win over config
    assert labels["app.kubernetes.io/name"] == metadata.APP  # ours stay ours
    deployment = next(c for c in children.apply if c["kind"] == "Deployment")
    assert "release" not in deployment["metadata"]["labels"]
