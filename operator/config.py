"""Operator-wide settings, read once from the environment (the chart and operator.yaml set them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

MANAGER = "kvpark-operator"  # app.kubernetes.io/managed-by on children; the field manager


@dataclass(frozen=True)
class OperatorConfig:
    image: str = "kvpark/kvpark:0.1.0"  # the server image when a CR names none
    namespaces: tuple[str, ...] = ()  # watched namespaces; empty: all
    # never served there, even when watched: the cluster's own, with its privileged accounts
    protected_namespaces: tuple[str, ...] = ("kube-system", "kube-public", "kube-node-lease")
    reconcile_seconds: float = 60.0  # the timer that re-creates deleted children
    pod_monitor: str = "auto"  # auto: when the CRD is served; false: never
    # labels on every PodMonitor (e.g. release=kube-prometheus-stack); a CR's own win
    pod_monitor_labels: tuple[tuple[str, str], ...] = ()
    scrape_interval: str = "15s"
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"
    liveness: str = "http://0.0.0.0:8080/healthz"  # kopf's liveness endpoint; "" disables it
    # kopf's peering object (replicas pause but one, peering.py); "": one replica, --standalone
    peering: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorConfig:
        default = cls()
        return cls(
            image=env.get("KVPARK_SERVER_IMAGE", default.image),
            namespaces=parse_names(env.get("KVPARK_WATCH_NAMESPACES", "")),
            protected_namespaces=parse_names(env.get("KVPARK_PROTECTED_NAMESPACES",
                                                     ",".join(default.protected_namespaces))),
            reconcile_seconds=float(env.get("KVPARK_RECONCILE_SECONDS", default.reconcile_seconds)),
            pod_monitor=env.get("KVPARK_POD_MONITOR", default.pod_monitor).lower(),
            pod_monitor_labels=parse_labels(env.get("KVPARK_POD_MONITOR_LABELS", "")),
            scrape_interval=env.get("KVPARK_SCRAPE_INTERVAL", default.scrape_interval),
            prometheus_address=env.get("KVPARK_PROMETHEUS_ADDRESS", default.prometheus_address),
            liveness=env.get("KVPARK_LIVENESS", default.liveness),
            peering=env.get("KVPARK_PEERING", default.peering),
        )


def parse_names(text: str) -> tuple[str, ...]:
    """`a, b` -> ("a", "b"); empty items dropped."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` (as the chart writes metrics.podMonitorLabels) -> sorted pairs."""
    pairs = (item.strip().partition("=") for item in text.split(",") if item.strip())
    return tuple(sorted((k.strip(), v.strip()) for k, _, v in pairs))
