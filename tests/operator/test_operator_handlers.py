"""The operator's entry point and its reconcile logic, with `kube` replaced by an in-memory fake
(no API at all): what gets applied, deleted and written to the status, and when."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from kvpark.operator import builders, crd, handlers, kube
from kvpark.operator.__main__ import get_kopf_args
from kvpark.operator.config import OperatorConfig


def test_kopf_args() -> None:
    assert get_kopf_args(OperatorConfig()) == [
        "run", "--standalone", "-m", "kvpark.operator.handlers", "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz"]
    args = get_kopf_args(OperatorConfig(namespaces=("a", "b"), liveness=""))
    assert args[-2:] == ["--namespace=a", "--namespace=b"]
    assert "--all-namespaces" not in args and not any(a.startswith("--liveness") for a in args)


def test_config_from_env() -> None:
    config = OperatorConfig.from_env({
        "KVPARK_SERVER_IMAGE": "img:1", "KVPARK_WATCH_NAMESPACES": " a, ,b ",
        "KVPARK_RECONCILE_SECONDS": "7.5", "KVPARK_POD_MONITOR": "False",
        "KVPARK_LIVENESS": ""})
    assert config == OperatorConfig(image="img:1", namespaces=("a", "b"), reconcile_seconds=7.5,
                                    pod_monitor="false", liveness="")
    assert OperatorConfig.from_env({}) == OperatorConfig()


class FakeKube:
    """kube.py's functions over a dict; records every write."""

    def __init__(self, served: set[str] = frozenset()) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.served = set(served)
        self.writes: list[tuple[str, str, str]] = []
        self.rejects: set[str] = set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kube, "get_served", lambda apis: {a for a in apis if a in self.served})
        monkeypatch.setattr(kube, "apply", self.apply)
        monkeypatch.setattr(kube, "delete", self.delete)
        monkeypatch.setattr(kube, "get", self.get)
        monkeypatch.setattr(kube, "patch_status", self.patch_status)

    def apply(self, obj: dict) -> dict:
        if obj["kind"] in self.rejects:
            raise kube.Rejected(f"{obj['kind']} is invalid: spec.x: Invalid value")
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.objects[key] = copy.deepcopy(obj)
        self.writes.append(("apply", *key))
        return obj

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        self.writes.append(("delete", kind, name))
        return self.objects.pop((kind, namespace, name), None) is not None

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        self.writes.append(("status", crd.KIND, name))
        self.objects[(crd.KIND, namespace, name)]["status"] = copy.deepcopy(status)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeKube:
    fake = FakeKube()
    fake.install(monkeypatch)
    return fake


def add_server(fake: FakeKube, spec: dict[str, Any], name: str = "s") -> dict:
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": spec}
    fake.objects[(crd.KIND, "ns", name)] = body
    return body


def conditions(fake: FakeKube, name: str = "s") -> dict[str, dict]:
    server = fake.objects[(crd.KIND, "ns", name)]
    return {c["type"]: c for c in server["status"]["conditions"]}


def test_reconcile_applies_children_and_writes_status(fake: FakeKube) -> None:
    handlers.reconcile(add_server(fake, {"replicas": 2}))
    kinds = [w[1] for w in fake.writes if w[0] == "apply"]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget"]
    assert ("delete", "HorizontalPodAutoscaler", "s") in fake.writes
    status = fake.objects[(crd.KIND, "ns", "s")]["status"]
    assert status["endpoint"] == "http://s.ns.svc:8080" and status["preemptRamMiB"] == 180
    assert conditions(fake)["Ready"]["reason"] == "ReplicasNotReady"


def test_unchanged_status_is_not_written_again(fake: FakeKube) -> None:
    handlers.reconcile(add_server(fake, {}))
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert [w[0] for w in fake.writes].count("status") == 1


def test_a_blocking_problem_leaves_the_children_alone(fake: FakeKube) -> None:
    handlers.reconcile(add_server(fake, {"preempt": {"ramMiB": -1}}))
    assert [w for w in fake.writes if w[0] != "status"] == []
    degraded = conditions(fake)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "CannotSizeMemory")


def test_a_rejected_child_is_reported_and_the_rest_applied(fake: FakeKube) -> None:
    fake.rejects.add("Service")
    handlers.reconcile(add_server(fake, {}))
    assert ("Deployment", "ns", "s") in fake.objects
    degraded = conditions(fake)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildRejected")
    assert "Service is invalid" in degraded["message"]


def test_served_apis_decide_the_optional_children(fake: FakeKube) -> None:
    fake.served = {builders.POD_MONITORS}
    handlers.reconcile(add_server(fake, {}))
    assert ("PodMonitor", "ns", "s") in fake.objects
    assert "PodMonitor" not in conditions(fake)["Ready"]["message"]


def test_a_server_being_deleted_is_left_to_the_garbage_collector(fake: FakeKube) -> None:
    body = add_server(fake, {})
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    handlers.reconcile(body)
    assert fake.writes == []


def deployment_body(owner: str, controller: bool = True) -> kopf.Body:
    return kopf.Body({"metadata": {"name": owner, "namespace": "ns", "ownerReferences": [
        {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": owner, "uid": "u-1",
         "controller": controller}]}})


def test_deployment_events_reconcile_their_owner(fake: FakeKube,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(handlers, "reconcile", lambda body: seen.append(body["metadata"]["name"]))
    add_server(fake, {}, name="alive")
    handlers.deployment_event(body=deployment_body("alive"))
    handlers.deployment_event(body=deployment_body("gone"))  # its PreemptServer was deleted
    handlers.deployment_event(body=deployment_body("alive", controller=False))
    assert seen == ["alive"]
