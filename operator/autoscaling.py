"""Pure: scaling a PreemptServer on its own metrics: the signals (parked requests, park rate, KV
usage), the HorizontalPodAutoscaler (through prometheus-adapter) or KEDA ScaledObject that
scales it, and the PodMonitor that has Prometheus scrape the pods those signals come from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kubernetes.utils.quantity import parse_quantity

from kvpark.operator import crd
from kvpark.operator.config import OperatorConfig
from kvpark.operator.metadata import get_metadata, get_selector_labels

POD_MONITORS = "monitoring.coreos.com/v1/podmonitors"
SCALED_OBJECTS = "keda.sh/v1alpha1/scaledobjects"


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

