"""The operator against an EMULATED Kubernetes API (kmock on 127.0.0.1, see kmock_harness.py)
that serves neither the Prometheus Operator's PodMonitors nor KEDA's ScaledObjects: the operator
must say so in the conditions instead of failing."""

from __future__ import annotations

import pytest
from kmock_harness import CORE_RESOURCES, Cluster, condition, running_operator


# kmock only: a real cluster serves the APIs it has (the shared tests add stand-in PodMonitor and
# ScaledObject CRDs), and the first test reads kmock's request log.
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with running_operator(CORE_RESOURCES, tmp_path_factory.mktemp("kmock")) as cluster:
        yield cluster


def test_without_podmonitor_api_the_ready_condition_says_so(cluster: Cluster) -> None:
    cluster.create_server("bare", "s", {})
    cluster.wait_child("Deployment", "bare", "s")
    server = cluster.wait_condition("bare", "s", "Ready", "False")
    assert "no PodMonitor" in condition(server, "Ready")["message"]
    assert condition(server, "Degraded")["status"] == "False"
    calls = {(r.method, r.resource.plural if r.resource else None)
             for r in cluster.server.requests()}
    assert ("PATCH", "podmonitors") not in calls and ("POST", "podmonitors") not in calls


def test_keda_without_keda_is_degraded_but_serves(cluster: Cluster) -> None:
    cluster.create_server("nokeda", "s", {"autoscaling": {"engine": "keda", "maxReplicas": 2}})
    server = cluster.wait_condition("nokeda", "s", "Degraded", "True", "AutoscalerUnavailable")
    assert "keda.sh" in condition(server, "Degraded")["message"]
    cluster.wait_child("Deployment", "nokeda", "s")  # the rest is applied anyway
    cluster.wait_child("Service", "nokeda", "s")
    assert cluster.get("HorizontalPodAutoscaler", "nokeda", "s") is None
