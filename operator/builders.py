"""Pure: a PreemptServer -> the plain dicts of its children (and, from `validation.py`, the
problems only we can see): the server's Deployment and pod, its Service, PodDisruptionBudget and
InferencePool here; the model's volumes in `model_source.py`, the KV disk tier's in `kv_cache.py`,
the autoscaler and PodMonitor in `autoscaling.py`.

Every child is named like the PreemptServer (the KV disk tier's shared claim `<name>-kv-cache`),
lives in its namespace and is owned by it (a controller owner reference, `metadata.py`), so
deleting the PreemptServer garbage-collects them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from typing import Any, NamedTuple

from kubernetes.utils.quantity import parse_quantity

from kvpark.operator import autoscaling, kv_cache, kv_events, model_source, podtemplate, validation
from kvpark.operator.config import OperatorConfig
from kvpark.operator.metadata import get_labels, get_metadata, get_selector_labels
from kvpark.operator.security import get_container_security, get_pod_security
from kvpark.operator.sizing import Sizing
from kvpark.operator.status import Problem
from kvpark.pod import args as server_args  # argparse only: the operator needs no torch

PORT = 8080
CONTAINER = "server"
PRESTOP_SECONDS = 5  # endpoints drop the pod before SIGTERM reaches the server
GRACE_MARGIN_SECONDS = 15
TMP_SIZE = "2Gi"  # the /tmp emptyDir (caches: HF, Triton, FlashInfer JIT)
GPU = "nvidia.com/gpu"
# the Gateway API Inference Extension, GA group first: the operator makes its pool in the first
# one the cluster serves
INFERENCE_POOLS = ("inference.networking.k8s.io/v1/inferencepools",
                   "inference.networking.x-k8s.io/v1alpha2/inferencepools")


class Children(NamedTuple):
    apply: list[dict[str, Any]]  # desired objects, applied in this order
    delete: list[tuple[str, str, str]]  # (apiVersion, kind, name) that must not exist
    problems: list[Problem]
    notes: list[str]  # said in the Ready condition's message


def get_endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{PORT}"


def get_threads(spec: Mapping[str, Any]) -> int | None:
    """CPU serving: as many threads as the CPU request, not the node's core count (the pod sets
    no CPU limit, so the server would see every core of the node)."""
    cpu = spec["resources"].get("cpu")
    if spec["resources"]["gpus"] or cpu is None:
        return None
    return max(1, math.ceil(parse_quantity(cpu)))


def get_server_args(spec: Mapping[str, Any], sizing: Sizing, model_flag: str) -> list[str]:
    args = ["--host", "0.0.0.0", "--port", str(PORT), "--model", model_flag,
            "--parallel", str(spec["parallel"]), "--ctx-size", str(spec["contextSize"]),
            "--page-size", str(spec["pageSize"]),
            "--shutdown-timeout", str(spec["server"]["shutdownTimeoutSeconds"])]
    if spec["preempt"]["enabled"]:
        args += ["--preempt", "--preempt-ram", str(sizing.preempt_ram)]
    else:
        args += ["--no-preempt"]
    threads = get_threads(spec)
    if threads is not None:  # within the server's own limits on each flag
        args += ["--threads", str(min(threads, server_args.MAX_TORCH_THREADS)),
                 "--kernel-threads", str(min(threads, server_args.MAX_KERNEL_THREADS))]
    return args + kv_cache.get_server_args(spec) + kv_events.get_server_args(spec) \
        + list(spec["server"].get("args", []))


def get_env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KVPARK_MEMORY_LIMIT", "valueFrom": {"resourceFieldRef": {
            "containerName": CONTAINER, "resource": "limits.memory", "divisor": "1"}}},
        # the root filesystem is read-only: caches go to the /tmp emptyDir
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/.triton"},
    ]
    env += kv_events.get_env(spec)  # the pod IP the events' topic names
    ref = spec["server"].get("apiKeySecretRef")
    if ref is not None:
        env.append({"name": "KVPARK_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": ref["name"], "key": ref.get("key", "api-key")}}})
    return env + [dict(e) for e in spec["server"].get("env", [])]


def get_resources(spec: Mapping[str, Any], sizing: Sizing) -> dict[str, Any]:
    res = spec["resources"]
    limits: dict[str, Any] = {"memory": sizing.memory}
    requests: dict[str, Any] = {"memory": sizing.memory}  # = limit: parking never meets eviction
    if res.get("cpu") is not None:
        requests["cpu"] = str(res["cpu"])
    if res["gpus"]:
        limits[GPU] = str(res["gpus"])
    if spec["model"]["uri"].startswith("hf://") and "cache" not in spec["model"]:
        # the download lies on the node's disk: schedule where it fits
        download = model_source.get_download_size(spec["model"])
        disk = parse_quantity(download) + parse_quantity(TMP_SIZE)
        requests["ephemeral-storage"] = f"{math.ceil(disk / (1 << 20))}Mi"
    return {"limits": limits, "requests": requests}


def get_probes() -> dict[str, Any]:
    def probe(period: int, failures: int, timeout: int) -> dict[str, Any]:
        return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
                "failureThreshold": failures, "timeoutSeconds": timeout}

    # /health answers 503 while the model loads: startup allows 15 minutes for that
    return {"startupProbe": probe(5, 180, 3), "readinessProbe": probe(5, 2, 3),
            "livenessProbe": probe(10, 6, 5)}


def get_container(spec: Mapping[str, Any], sizing: Sizing, source: model_source.ModelSource,
                  image: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": ["kvpark-server"],
        "args": get_server_args(spec, sizing, source.flag),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"},
                  *kv_events.get_ports(spec)],
        "env": get_env(spec),
        "resources": get_resources(spec, sizing),
        **get_probes(),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "securityContext": get_container_security(),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": "/tmp"}, *source.mounts,
                         *kv_cache.get_mounts(spec)],
    }
    if "imagePullPolicy" in spec:
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def get_grace_seconds(spec: Mapping[str, Any]) -> int:
    """preStop, the drain, then the disk tier's write-out must all end before the SIGKILL."""
    return PRESTOP_SECONDS + spec["server"]["shutdownTimeoutSeconds"] \
        + kv_cache.get_write_out_seconds(spec) + GRACE_MARGIN_SECONDS


def get_pod_spec(name: str, spec: Mapping[str, Any], sizing: Sizing,
                 config: OperatorConfig) -> dict[str, Any]:
    image = spec.get("image") or config.image
    source = model_source.get_model_source(name, spec, image)
    tolerations = [dict(t) for t in spec.get("tolerations", [])]
    if spec["resources"]["gpus"]:
        tolerations.append({"key": GPU, "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the server never calls the API
        # Service links would put e.g. KVPARK_PORT=tcp://... into the env for a Service named
        # kvpark, and every KVPARK_<FLAG> variable is a server flag.
        "enableServiceLinks": False,
        "securityContext": {**get_pod_security(), **kv_cache.get_pod_security(spec)},
        "terminationGracePeriodSeconds": get_grace_seconds(spec),
        "initContainers": source.init_containers,
        "containers": [get_container(spec, sizing, source, image)],
        "volumes": [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{sizing.shm_mib}Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
            *source.volumes,
            *kv_cache.get_volumes(name, spec),
        ],
        "nodeSelector": dict(spec.get("nodeSelector", {})),
        "tolerations": tolerations,
        "imagePullSecrets": [{"name": s["name"]} for s in spec.get("imagePullSecrets", [])],
    }
    return pod


def get_deployment(body: Mapping[str, Any], spec: Mapping[str, Any], sizing: Sizing,
                   config: OperatorConfig) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": get_metadata(body),
        "spec": {
            "replicas": spec["replicas"],
            "selector": {"matchLabels": get_selector_labels(name)},
            "strategy": get_strategy(spec),
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1800,
            "template": get_pod_template(name, spec, sizing, config),
        },
    }


def get_pod_template(name: str, spec: Mapping[str, Any], sizing: Sizing,
                     config: OperatorConfig) -> dict[str, Any]:
    """The pod template, with spec.podTemplate merged over it (podtemplate.py)."""
    labels = {**get_labels(name), **kv_events.get_pod_labels(spec)}
    template = {"metadata": {"labels": labels},
                "spec": get_pod_spec(name, spec, sizing, config)}
    return podtemplate.merge(template, spec.get("podTemplate") or {})


def get_strategy(spec: Mapping[str, Any]) -> dict[str, Any]:
    """By default a new pod must be ready before an old one drains its parked requests."""
    strategy = spec["strategy"]
    if strategy["type"] == "Recreate":
        return {"type": "Recreate"}
    return {"type": "RollingUpdate", "rollingUpdate": {
        "maxUnavailable": strategy["maxUnavailable"], "maxSurge": strategy["maxSurge"]}}


def get_service(body: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": get_metadata(body),
        "spec": {
            "type": "ClusterIP",
            "selector": get_selector_labels(body["metadata"]["name"]),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def get_pdb(body: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": get_metadata(body),
        "spec": {"maxUnavailable": 1,
                 "selector": {"matchLabels": get_selector_labels(body["metadata"]["name"])}},
    }


def get_inference_pool(body: Mapping[str, Any], spec: Mapping[str, Any],
                       api: str) -> dict[str, Any]:
    """An InferencePool of the server's pods, for a Gateway and its endpoint picker (EPP), which
    scrapes the pods' /metrics on the target port (README: the flags that name kvpark's
    metrics). `api` is one of INFERENCE_POOLS; the two versions spell the same fields apart."""
    picker = spec["routing"]["inferencePool"]["endpointPicker"]
    selector = get_selector_labels(body["metadata"]["name"])
    api_version = api.rpartition("/")[0]
    if api_version == "inference.networking.k8s.io/v1":
        pool = {"selector": {"matchLabels": selector}, "targetPorts": [{"number": PORT}],
                "endpointPickerRef": {"name": picker["name"], "kind": "Service",
                                      "port": {"number": picker["port"]},
                                      "failureMode": picker["failureMode"]}}
    else:
        pool = {"selector": selector, "targetPortNumber": PORT,
                "extensionRef": {"name": picker["name"], "kind": "Service",
                                 "portNumber": picker["port"],
                                 "failureMode": picker["failureMode"]}}
    return {"apiVersion": api_version, "kind": "InferencePool", "metadata": get_metadata(body),
            "spec": pool}


def get_claims(body: Mapping[str, Any],
               spec: Mapping[str, Any]) -> dict[str, dict[str, Any] | None]:
    """The PersistentVolumeClaims the operator may make, by name; None: not wanted (one it made
    before is deleted)."""
    name = body["metadata"]["name"]
    return {name: model_source.get_cache_pvc(body, spec),
            kv_cache.get_claim_name(name): kv_cache.get_pvc(body, spec)}


def get_children(body: Mapping[str, Any], spec: Mapping[str, Any], sizing: Sizing,
                 config: OperatorConfig, served: Set[str]) -> Children:
    """What to apply and what to delete; `served` holds the optional APIs the cluster serves."""
    name = body["metadata"]["name"]
    problems = validation.get_namespace_problems(body["metadata"]["namespace"],
                                                 config.protected_namespaces)
    problems += validation.get_spec_problems(spec, get_selector_labels(name), CONTAINER)
    problems += [sizing.problem] if sizing.problem else []
    claims = get_claims(body, spec)
    apply = [claim for claim in claims.values() if claim is not None]  # before their pods
    apply += [get_deployment(body, spec, sizing, config), get_service(body)]
    delete = [("v1", "PersistentVolumeClaim", claim_name)
              for claim_name, claim in claims.items() if claim is None]
    notes: list[str] = []
    if spec["replicas"] > 1:
        apply.append(get_pdb(body))
    else:
        delete.append(("policy/v1", "PodDisruptionBudget", name))
    scaling = spec.get("autoscaling")
    hpa = ("autoscaling/v2", "HorizontalPodAutoscaler", name)
    scaled = ("keda.sh/v1alpha1", "ScaledObject", name)
    keda_served = autoscaling.SCALED_OBJECTS in served
    if scaling is None or scaling["engine"] == "hpa":
        if scaling is None:
            delete.append(hpa)
        else:
            apply.append(autoscaling.get_hpa(body, spec))
        if keda_served:
            delete.append(scaled)
    else:
        delete.append(hpa)
        if keda_served:
            apply.append(autoscaling.get_scaled_object(body, spec, config))
        else:
            problems.append(Problem("AutoscalerUnavailable", "autoscaling.engine is keda but "
                                    "the cluster does not serve keda.sh/v1alpha1 ScaledObjects",
                                    blocking=False))
    pool_api = next((api for api in INFERENCE_POOLS if api in served), None)
    if "inferencePool" not in spec.get("routing", {}):
        if pool_api is not None:
            delete.append((pool_api.rpartition("/")[0], "InferencePool", name))
    elif pool_api is not None:
        apply.append(get_inference_pool(body, spec, pool_api))
    else:
        problems.append(Problem("InferencePoolUnavailable", "routing.inferencePool is set but "
                                "the cluster serves no InferencePool (install the Gateway API "
                                "Inference Extension CRDs)", blocking=False))
    if kv_events.get_settings(spec) is not None:
        apply.append(kv_events.get_config_map(body, spec))
    else:
        delete.append(("v1", "ConfigMap", name))
    if config.pod_monitor == "false":
        notes.append("PodMonitor disabled in the operator's settings")
        if autoscaling.POD_MONITORS in served:
            delete.append(("monitoring.coreos.com/v1", "PodMonitor", name))
    elif autoscaling.POD_MONITORS in served:
        apply.append(autoscaling.get_pod_monitor(body, spec, config))
    else:
        notes.append("no PodMonitor: the cluster does not serve monitoring.coreos.com/v1 "
                     "PodMonitors (install the Prometheus Operator CRDs)")
    return Children(apply, delete, problems, notes)
