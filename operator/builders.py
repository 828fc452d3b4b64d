"""Pure: a PreemptServer -> the plain dicts of its children (and, from `validation.py`, the
problems only we can see).

Every child is named like the PreemptServer, lives in its namespace and is owned by it (a
controller owner reference), so deleting the PreemptServer garbage-collects them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from typing import Any, NamedTuple

from kubernetes.utils.quantity import parse_quantity

from kvpark.operator import crd, podtemplate, validation
from kvpark.operator.config import MANAGER, OperatorConfig
from kvpark.operator.sizing import Sizing
from kvpark.operator.status import Problem
from kvpark.pod import args as server_args  # argparse only: the operator needs no torch

APP = "kvpark-server"
PORT = 8080
CONTAINER = "server"
MODELS_DIR = "/models"
PRESTOP_SECONDS = 5  # endpoints drop the pod before SIGTERM reaches the server
GRACE_MARGIN_SECONDS = 15
UID = 10001  # the image's unprivileged user
TMP_SIZE = "2Gi"  # the /tmp emptyDir (caches: HF, Triton, FlashInfer JIT)
GPU = "nvidia.com/gpu"
POD_MONITORS = "monitoring.coreos.com/v1/podmonitors"
SCALED_OBJECTS = "keda.sh/v1alpha1/scaledobjects"
# the Gateway API Inference Extension, GA group first: the operator makes its pool in the first
# one the cluster serves
INFERENCE_POOLS = ("inference.networking.k8s.io/v1/inferencepools",
                   "inference.networking.x-k8s.io/v1alpha2/inferencepools")

class Signal(NamedTuple):
    hpa_metric: str  # the name prometheus-adapter serves (manifests/autoscaling/)
    promql: str  # for KEDA; {sel} is the label matcher
    default: str  # per-pod threshold


SIGNALS = {
    "parkedRequests": Signal(
        "kvpark_requests_preempted", "sum(kvpark:requests_preempted{{{sel}}})", "1"),
    "preemptRate": Signal(
        "kvpark_preempt_rate", "sum(rate(kvpark:n_preempt_total{{{sel}}}[2m]))", "0.5"),
    "kvUsage": Signal(
        "kvpark_kv_cache_usage_ratio", "sum(kvpark:kv_cache_usage_ratio{{{sel}}})", "0.8"),
}


class ModelSource(NamedTuple):
    flag: str  # --model
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]


class Children(NamedTuple):
    apply: list[dict[str, Any]]  # desired objects, applied in this order
    delete: list[tuple[str, str, str]]  # (apiVersion, kind, name) that must not exist
    problems: list[Problem]
    notes: list[str]  # said in the Ready condition's message


def get_selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": name}


def get_labels(name: str) -> dict[str, str]:
    return {
        **get_selector_labels(name),
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/part-of": "kvpark",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def get_selector(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(get_selector_labels(name).items()))


def get_endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{PORT}"


def get_owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """The controller reference; blockOwnerDeletion makes a foreground deletion of the
    PreemptServer wait for the child (the operator needs `update` on preemptservers/finalizers
    for it where the OwnerReferencesPermissionEnforcement admission plugin runs)."""
    meta = body["metadata"]
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def get_metadata(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"name": meta["name"], "namespace": meta["namespace"],
            "labels": get_labels(meta["name"]), "ownerReferences": [get_owner_reference(body)]}


def get_container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def get_model_source(name: str, spec: Mapping[str, Any], image: str) -> ModelSource:
    model = spec["model"]
    uri: str = model["uri"]
    if uri.startswith("file://"):
        return ModelSource(uri.removeprefix("file://"), [], [], [])
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        mount = f"{MODELS_DIR}/pvc"
        return ModelSource(
            f"{mount}/{path}".rstrip("/"),
            [{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            [{"name": "model", "mountPath": mount, "readOnly": True}],
            [],
        )
    if uri.startswith("hf://"):
        org, repo, *rest = uri.removeprefix("hf://").split("/")
        mount = f"{MODELS_DIR}/hf"
        path = "/".join(rest)
        claim = get_cache_claim(name, model)
        if claim is None:
            return ModelSource(
                f"{mount}/{path}".rstrip("/"),
                [{"name": "model", "emptyDir": {"sizeLimit": get_download_size(model)}}],
                [{"name": "model", "mountPath": mount, "readOnly": True}],
                [get_fetch_container(model, f"{org}/{repo}", path, mount, image, spec)],
            )
        # one folder per repository and revision: PreemptServers may share a claim
        folder = f"{mount}/{org}/{repo}/{model.get('revision', DEFAULT_BRANCH_FOLDER)}"
        return ModelSource(
            f"{folder}/{path}".rstrip("/"),
            [{"name": "model", "persistentVolumeClaim": {"claimName": claim}}],
            [{"name": "model", "mountPath": mount, "readOnly": True}],
            [get_fetch_container(model, f"{org}/{repo}", path, folder, image, spec,
                                 cached=True, mount=mount)],
        )
    return ModelSource(uri, [], [], [])  # builtin://


def get_cache_claim(name: str, model: Mapping[str, Any]) -> str | None:
    """The PVC of an hf:// model's shared cache: the user's claim, or the one the operator makes
    (named like the PreemptServer); None: an emptyDir per pod."""
    pvc = (model.get("cache") or {}).get("pvc")
    if pvc is None:
        return None
    return str(pvc.get("claimName") or name)


def get_cache_pvc(body: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cache PVC the operator makes (cache.pvc.size given), owned by the PreemptServer: it
    goes with it (name an existing claimName to keep the cache)."""
    pvc = (spec["model"].get("cache") or {}).get("pvc") or {}
    if not spec["model"]["uri"].startswith("hf://") or "size" not in pvc:
        return None
    claim: dict[str, Any] = {
        "accessModes": [pvc["accessMode"]],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": str(pvc["size"])}},
    }
    if "storageClassName" in pvc:
        claim["storageClassName"] = pvc["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": get_metadata(body),
            "spec": claim}


def get_download_size(model: Mapping[str, Any]) -> str:
    """hf:// models: how much the model emptyDir may hold (the kubelet evicts a pod above)."""
    if "downloadSize" in model:
        return str(model["downloadSize"])
    if "sizeMiB" in model:
        return f"{math.ceil(model['sizeMiB'] * 11 / 10) + 1024}Mi"
    return crd.DEFAULT_DOWNLOAD_SIZE


# The shared cache's download: one pod at a time per folder (flock on a file in it, which NFS
# and CephFS honour across nodes), skipped once a complete download left its marker. A pod
# killed mid-download leaves no marker; the next one resumes where it stopped.
CACHE_MARKER = ".kvpark-complete"
CACHED_FETCH = f"""set -eu
folder="$1"; shift
mkdir -p "$folder"
exec 9>>"$folder/.kvpark-lock"
flock 9
if [ -f "$folder/{CACHE_MARKER}" ]; then
  echo "kvpark: $folder is complete in the cache"; exit 0
fi
"$@" --local-dir "$folder"
date -u +%Y-%m-%dT%H:%M:%SZ > "$folder/{CACHE_MARKER}"
"""
DEFAULT_BRANCH_FOLDER = "default-branch"  # defaultBranch: true: the first download stays


def get_fetch_container(model: Mapping[str, Any], repo: str, path: str, folder: str, image: str,
                        spec: Mapping[str, Any], cached: bool = False,
                        mount: str = "") -> dict[str, Any]:
    download = ["hf", "download", repo, *([path] if path else [])]
    revision = ["--revision", model["revision"]] if "revision" in model else []
    if cached:
        command = ["sh", "-c", CACHED_FETCH, "fetch-model", folder, *download, *revision]
    else:
        command = [*download, "--local-dir", folder, *revision]
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"},
           {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if "hfTokenSecretRef" in model:
        ref = model["hfTokenSecretRef"]
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": ref["name"], "key": ref.get("key", "token")}}})
    container = {
        "name": "fetch-model",
        "image": image,
        "command": command,
        "env": env,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "securityContext": get_container_security(),
        "volumeMounts": [{"name": "model", "mountPath": mount or folder},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    if "imagePullPolicy" in spec:
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


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
    if threads is not None:  # the server's limits: 512 torch threads, 64 C kernel threads
        args += ["--threads", str(min(threads, server_args.MAX_TORCH_THREADS)),
                 "--kernel-threads", str(min(threads, server_args.MAX_KERNEL_THREADS))]
    return args + list(spec["server"].get("args", []))


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
        disk = parse_quantity(get_download_size(spec["model"])) + parse_quantity(TMP_SIZE)
        requests["ephemeral-storage"] = f"{math.ceil(disk / (1 << 20))}Mi"
    return {"limits": limits, "requests": requests}


def get_probes() -> dict[str, Any]:
    def probe(period: int, failures: int, timeout: int) -> dict[str, Any]:
        return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
                "failureThreshold": failures, "timeoutSeconds": timeout}

    # /health answers 503 while the model loads: startup allows 15 minutes for that
    return {"startupProbe": probe(5, 180, 3), "readinessProbe": probe(5, 2, 3),
            "livenessProbe": probe(10, 6, 5)}


def get_container(spec: Mapping[str, Any], sizing: Sizing, source: ModelSource,
                  image: str) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": ["kvpark-server"],
        "args": get_server_args(spec, sizing, source.flag),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": get_env(spec),
        "resources": get_resources(spec, sizing),
        **get_probes(),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "securityContext": get_container_security(),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "tmp", "mountPath": "/tmp"}, *source.mounts],
    }
    if "imagePullPolicy" in spec:
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def get_pod_spec(name: str, spec: Mapping[str, Any], sizing: Sizing,
                 config: OperatorConfig) -> dict[str, Any]:
    image = spec.get("image") or config.image
    source = get_model_source(name, spec, image)
    tolerations = [dict(t) for t in spec.get("tolerations", [])]
    if spec["resources"]["gpus"]:
        tolerations.append({"key": GPU, "operator": "Exists", "effect": "NoSchedule"})
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the server never calls the API
        # Service links would put e.g. KVPARK_PORT=tcp://... into the env for a Service named
        # kvpark, and every KVPARK_<FLAG> variable is a server flag.
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID,
                            "fsGroup": UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": PRESTOP_SECONDS
        + spec["server"]["shutdownTimeoutSeconds"] + GRACE_MARGIN_SECONDS,
        "initContainers": source.init_containers,
        "containers": [get_container(spec, sizing, source, image)],
        "volumes": [
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{sizing.shm_mib}Mi"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
            *source.volumes,
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
    template = {"metadata": {"labels": get_labels(name)},
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


def get_scale_target(body: Mapping[str, Any]) -> dict[str, str]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": body["metadata"]["name"]}


def get_target(spec: Mapping[str, Any]) -> tuple[Signal, str]:
    target = spec["autoscaling"]["target"]
    signal = SIGNALS[target["signal"]]
    return signal, str(target.get("averageValue", signal.default))


def get_hpa_behavior() -> dict[str, Any]:
    # parked requests come and go in bursts: scale down only after 5 quiet minutes
    return {"scaleDown": {"stabilizationWindowSeconds": 300}}


def get_hpa(body: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    scaling = spec["autoscaling"]
    signal, value = get_target(spec)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": get_metadata(body),
        "spec": {
            "scaleTargetRef": get_scale_target(body),
            "minReplicas": scaling["minReplicas"],
            "maxReplicas": scaling["maxReplicas"],
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": signal.hpa_metric},
                "target": {"type": "AverageValue", "averageValue": value}}}],
            "behavior": get_hpa_behavior(),
        },
    }


def get_promql(spec: Mapping[str, Any], namespace: str, name: str) -> str:
    signal, _ = get_target(spec)
    return signal.promql.format(sel=f'namespace="{namespace}",app_kubernetes_io_instance="{name}"')


def get_scaled_object(body: Mapping[str, Any], spec: Mapping[str, Any],
                      config: OperatorConfig) -> dict[str, Any]:
    meta = body["metadata"]
    scaling = spec["autoscaling"]
    _, value = get_target(spec)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": get_metadata(body),
        "spec": {
            "scaleTargetRef": get_scale_target(body),
            "minReplicaCount": scaling["minReplicas"],
            "maxReplicaCount": scaling["maxReplicas"],
            "pollingInterval": 15,
            # No cooldownPeriod: KEDA uses it only for scaling to zero, and minReplicas >= 1.
            # The HPA that KEDA makes gets the same scale-down window as engine: hpa.
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": get_hpa_behavior()}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": scaling.get("prometheusAddress", config.prometheus_address),
                "query": get_promql(spec, meta["namespace"], meta["name"]),
                # KEDA parses a plain decimal, not a Kubernetes quantity such as 500m
                "threshold": str(parse_quantity(value).normalize()),
            }}],
        },
    }


def get_pod_monitor(body: Mapping[str, Any], spec: Mapping[str, Any],
                    config: OperatorConfig) -> dict[str, Any]:
    meta = get_metadata(body)
    # a Prometheus picks PodMonitors by label (kube-prometheus-stack: release=RELEASE)
    wanted = spec.get("monitoring", {}).get("podMonitorLabels", {})
    meta["labels"] = {**dict(config.pod_monitor_labels), **wanted, **meta["labels"]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": get_selector_labels(body["metadata"]["name"])},
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics",
                                     "interval": config.scrape_interval}],
            # the KEDA queries select one server by this label
            "podTargetLabels": ["app.kubernetes.io/instance"],
        },
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


def get_children(body: Mapping[str, Any], spec: Mapping[str, Any], sizing: Sizing,
                 config: OperatorConfig, served: Set[str]) -> Children:
    """What to apply and what to delete; `served` holds the optional APIs the cluster serves."""
    name = body["metadata"]["name"]
    problems = validation.get_spec_problems(spec, get_selector_labels(name), CONTAINER)
    problems += [sizing.problem] if sizing.problem else []
    apply = [get_deployment(body, spec, sizing, config), get_service(body)]
    delete: list[tuple[str, str, str]] = []
    notes: list[str] = []
    cache = get_cache_pvc(body, spec)
    if cache is not None:
        apply.insert(0, cache)  # before the pods that mount it
    else:
        delete.append(("v1", "PersistentVolumeClaim", name))
    if spec["replicas"] > 1:
        apply.append(get_pdb(body))
    else:
        delete.append(("policy/v1", "PodDisruptionBudget", name))
    scaling = spec.get("autoscaling")
    hpa = ("autoscaling/v2", "HorizontalPodAutoscaler", name)
    scaled = ("keda.sh/v1alpha1", "ScaledObject", name)
    keda_served = SCALED_OBJECTS in served
    if scaling is None or scaling["engine"] == "hpa":
        if scaling is None:
            delete.append(hpa)
        else:
            apply.append(get_hpa(body, spec))
        if keda_served:
            delete.append(scaled)
    else:
        delete.append(hpa)
        if keda_served:
            apply.append(get_scaled_object(body, spec, config))
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
    if config.pod_monitor == "false":
        notes.append("PodMonitor disabled in the operator's settings")
        if POD_MONITORS in served:
            delete.append(("monitoring.coreos.com/v1", "PodMonitor", name))
    elif POD_MONITORS in served:
        apply.append(get_pod_monitor(body, spec, config))
    else:
        notes.append("no PodMonitor: the cluster does not serve monitoring.coreos.com/v1 "
                     "PodMonitors (install the Prometheus Operator CRDs)")
    return Children(apply, delete, problems, notes)
