"""The operator's entry point and its reconcile logic, with `kube` replaced by an in-memory fake
(no API at all): what gets applied, deleted and written to the status, and when."""

from __future__ import annotations

import copy
from typing import Any

import kopf
import pytest

from kvpark.operator import autoscaling, crd, handlers, kube, metadata
from kvpark.operator.__main__ import get_kopf_args
from kvpark.operator.config import OperatorConfig


def test_kopf_args() -> None:
    assert get_kopf_args(OperatorConfig()) == [
        "run", "-m", "kvpark.operator.handlers", "--standalone", "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz"]
    peered = get_kopf_args(OperatorConfig(peering="kvpark-operator"), priority=77)
    assert peered[3:5] == ["--peering=kvpark-operator", "--priority=77"]
    assert "--standalone" not in peered
    args = get_kopf_args(OperatorConfig(namespaces=("a", "b"), liveness=""))
    assert args[-2:] == ["--namespace=a", "--namespace=b"]
    assert "--all-namespaces" not in args and not any(a.startswith("--liveness") for a in args)


def test_config_from_env() -> None:
    config = OperatorConfig.from_env({
        "KVPARK_SERVER_IMAGE": "img:1", "KVPARK_WATCH_NAMESPACES": " a, ,b ",
        "KVPARK_RECONCILE_SECONDS": "7.5", "KVPARK_POD_MONITOR": "False",
        "KVPARK_LIVENESS": "", "KVPARK_POD_MONITOR_LABELS": "team=a, release=kps,"})
    assert config == OperatorConfig(image="img:1", namespaces=("a", "b"), reconcile_seconds=7.5,
                                    pod_monitor="false", liveness="",
                                    pod_monitor_labels=(("release", "kps"), ("team", "a")))
    assert OperatorConfig.from_env({}) == OperatorConfig()


class FakeKube:
    """kube.py's functions over a dict; records every write."""

    def __init__(self, served: set[str] = frozenset()) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.served = set(served)
        self.writes: list[tuple[str, str, str]] = []
        self.rejects: set[str] = set()
        self.errors: dict[str, kube.ApiError] = {}  # kind -> what applying it raises
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message)
        self.lists: list[tuple[str, str]] = []  # (kind, label selector)
        self.uids = iter(range(1000, 10**6))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(kube, "get_served", lambda apis: {a for a in apis if a in self.served})
        monkeypatch.setattr(kube, "apply", self.apply)
        monkeypatch.setattr(kube, "delete", self.delete)
        monkeypatch.setattr(kube, "get", self.get)
        monkeypatch.setattr(kube, "patch_status", self.patch_status)
        monkeypatch.setattr(kube, "post_event", self.post_event)
        monkeypatch.setattr(kube, "list_objects", self.list_objects)
        monkeypatch.setattr(handlers, "MEMORY", handlers.Memory())

    def apply(self, obj: dict) -> dict:
        if obj["kind"] in self.rejects:
            raise kube.Rejected(422, f"{obj['kind']} is invalid: spec.x: Invalid value")
        if obj["kind"] in self.errors:
            raise self.errors[obj["kind"]]
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        stored = copy.deepcopy(obj)
        old = self.objects.get(key)
        stored["metadata"]["uid"] = old["metadata"]["uid"] if old else f"uid-{next(self.uids)}"
        self.objects[key] = stored
        self.writes.append(("apply", *key))
        return copy.deepcopy(stored)

    def add(self, obj: dict) -> dict:
        """Someone else's object (or ours from before), as it is on the cluster."""
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"uid-{next(self.uids)}")
        self.objects[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return obj

    def delete(self, kind: str, namespace: str, name: str, uid: str,
               api_version: str = "") -> bool:
        self.writes.append(("delete", kind, name))
        assert self.objects[(kind, namespace, name)]["metadata"]["uid"] == uid
        return self.objects.pop((kind, namespace, name), None) is not None

    def list_objects(self, kind: str, namespace: str, selector: str) -> list[dict]:
        self.lists.append((kind, selector))
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == kind and ns == namespace]

    def post_event(self, body: dict, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def get(self, kind: str, namespace: str, name: str, api_version: str = "") -> dict | None:
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
    assert [w for w in fake.writes if w[0] == "delete"] == []  # no HPA was there to delete
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
    assert fake.events == [("Warning", "ChildRejected", degraded["message"])]
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert len(fake.events) == 1  # one Event per problem, not one per reconcile


def test_served_apis_decide_the_optional_children(fake: FakeKube) -> None:
    fake.served = {autoscaling.POD_MONITORS}
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
    handlers.server_event(type=None, body=kopf.Body(add_server(fake, {}, name="alive")))
    assert seen == ["alive"]  # a PreemptServer seen for the first time is reconciled
    seen.clear()
    handlers.deployment_event(body=deployment_body("alive"))
    handlers.deployment_event(body=deployment_body("gone"))  # its PreemptServer was deleted
    handlers.deployment_event(body=deployment_body("alive", controller=False))
    assert seen == ["alive"]


def foreign(kind: str, api_version: str, spec: dict, name: str = "s") -> dict:
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": "ns", "labels": {"team": "a"}}, "spec": spec}


def test_a_foreign_object_is_neither_adopted_nor_deleted(fake: FakeKube) -> None:
    """Defect 1: objects of the PreemptServer's name that it does not own are left alone."""
    service = fake.add(foreign("Service", "v1", {"selector": {"app": "team"}}))
    hpa = fake.add(foreign("HorizontalPodAutoscaler", "autoscaling/v2", {"maxReplicas": 9}))
    handlers.reconcile(add_server(fake, {}))  # wants a Service and no HPA
    assert fake.get("Service", "ns", "s") == service
    assert fake.get("HorizontalPodAutoscaler", "ns", "s") == hpa
    assert [w for w in fake.writes if w[0] in ("apply", "delete")] == [
        ("apply", "Deployment", "ns", "s")]
    degraded = conditions(fake)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "NameConflict")
    assert "Service s already exists, not owned by this PreemptServer" in degraded["message"]
    assert [(t, r) for t, r, _ in fake.events] == [("Warning", "NameConflict")]
    assert "observedGeneration" not in fake.get(crd.KIND, "ns", "s")["status"]
    # the team deletes its Service: the next reconcile makes ours
    del fake.objects[("Service", "ns", "s")]
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert fake.get("Service", "ns", "s")["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert conditions(fake)["Degraded"]["status"] == "False"
    assert fake.get(crd.KIND, "ns", "s")["status"]["observedGeneration"] == 1


def test_an_object_owned_by_an_older_server_of_the_name_is_left_to_the_gc(fake: FakeKube) -> None:
    old = foreign("Deployment", "apps/v1", {"replicas": 1})
    old["metadata"]["ownerReferences"] = [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                           "name": "s", "uid": "u-0", "controller": True}]
    fake.add(old)
    handlers.reconcile(add_server(fake, {}))
    assert ("apply", "Deployment", "ns", "s") not in fake.writes
    assert "owned by PreemptServer s" in conditions(fake)["Degraded"]["message"]


def test_switching_the_engine_deletes_the_old_autoscaler_first(fake: FakeKube) -> None:
    """Defect 2: KEDA refuses a ScaledObject while an HPA scales the same target."""
    fake.served = {autoscaling.SCALED_OBJECTS}
    body = add_server(fake, {"autoscaling": {"maxReplicas": 3}})
    handlers.reconcile(body)
    assert ("HorizontalPodAutoscaler", "ns", "s") in fake.objects
    fake.writes.clear()
    body = fake.get(crd.KIND, "ns", "s")
    body["spec"]["autoscaling"]["engine"] = "keda"
    body["metadata"]["generation"] = 2
    handlers.reconcile(body)
    writes = [w[:2] for w in fake.writes if w[0] in ("apply", "delete")]
    assert writes == [("delete", "HorizontalPodAutoscaler"), ("apply", "ScaledObject")]
    body = fake.get(crd.KIND, "ns", "s")
    body["spec"]["autoscaling"]["engine"] = "hpa"
    body["metadata"]["generation"] = 3
    fake.writes.clear()
    handlers.reconcile(body)
    writes = [w[:2] for w in fake.writes if w[0] in ("apply", "delete")]
    assert writes == [("delete", "ScaledObject"), ("apply", "HorizontalPodAutoscaler")]


@pytest.mark.parametrize("error", [
    kube.ApiError(403, 'admission webhook "vscaledobject.kb.io" denied the request: the workload '
                  "'s' of type 'kvpark.io/v1alpha1.PreemptServer' is already managed by the hpa "
                  "'other'"),
    kube.ApiError(503, "the server is currently unable to handle the request"),
], ids=["403", "503"])
def test_any_api_error_is_degraded_and_the_generation_is_not_claimed(
        fake: FakeKube, error: kube.ApiError) -> None:
    """Defect 2: 403 (webhooks, RBAC) and 5xx reach Degraded with the API server's message."""
    fake.served = {autoscaling.SCALED_OBJECTS}
    handlers.reconcile(add_server(fake, {}))
    assert fake.get(crd.KIND, "ns", "s")["status"]["observedGeneration"] == 1
    body = fake.get(crd.KIND, "ns", "s")
    body["spec"]["autoscaling"] = {"engine": "keda", "maxReplicas": 2}
    body["metadata"]["generation"] = 2
    fake.objects[(crd.KIND, "ns", "s")] = body
    fake.errors["ScaledObject"] = error
    handlers.reconcile(body)  # no exception: kopf would retry it and post an Event each time
    status = fake.get(crd.KIND, "ns", "s")["status"]
    degraded = conditions(fake)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "ApiError")
    assert str(error) in degraded["message"] and degraded["observedGeneration"] == 2
    assert status["observedGeneration"] == 1  # generation 2 is not applied
    assert [r for _, r, _ in fake.events] == ["ApiError"]
    del fake.errors["ScaledObject"]
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert fake.get(crd.KIND, "ns", "s")["status"]["observedGeneration"] == 2
    assert conditions(fake)["Degraded"]["status"] == "False"


def test_a_steady_state_writes_nothing(fake: FakeKube) -> None:
    """Defect 8: once the children are as wanted, a reconcile only reads."""
    fake.served = {autoscaling.POD_MONITORS, autoscaling.SCALED_OBJECTS}
    handlers.reconcile(add_server(fake, {"replicas": 1, "autoscaling": {"maxReplicas": 2}}))
    fake.writes.clear()
    for _ in range(3):
        handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert fake.writes == []
    # a hand edit of a field the operator sets is put back
    fake.objects[("Service", "ns", "s")]["spec"]["selector"] = {"app": "other"}
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert fake.writes == [("apply", "Service", "ns", "s")]


def test_a_foreign_deployment_lends_no_status(fake: FakeKube) -> None:
    """Issue 24: Ready and Progressing came from a team's Deployment of the same name."""
    team = foreign("Deployment", "apps/v1", {"replicas": 3})
    team["status"] = {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 0,
                      "availableReplicas": 3}
    fake.add(team)
    handlers.reconcile(add_server(fake, {}))
    found = conditions(fake)
    assert [found[t]["reason"] for t in ("Ready", "Progressing", "Degraded")] == [
        "NameConflict"] * 3
    assert found["Ready"]["status"] == "False"
    assert found["Ready"]["message"].startswith("Deployment s already exists, not owned")
    assert fake.get(crd.KIND, "ns", "s")["status"]["readyReplicas"] == 0
    assert ("Pod", metadata.get_selector("s")) not in fake.lists  # not its pods either


def test_an_autoscaler_that_cannot_scale_degrades_an_applied_generation(fake: FakeKube) -> None:
    """Issue 24: ScalingActive=False/FailedGetPodsMetric on the HPA, AsExpected on the CR. The
    children are applied all the same: observedGeneration moves."""
    failing = {"conditions": [
        {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
         "message": "unable to get metric kvpark_requests_preempted"}]}
    handlers.reconcile(add_server(fake, {"autoscaling": {"maxReplicas": 3}}))
    fake.objects[("HorizontalPodAutoscaler", "ns", "s")]["status"] = failing
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    degraded = conditions(fake)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "AutoscalerNotScaling")
    assert "ScalingActive=False (FailedGetPodsMetric)" in degraded["message"]
    assert fake.get(crd.KIND, "ns", "s")["status"]["observedGeneration"] == 1
    assert [r for _, r, _ in fake.events] == ["AutoscalerNotScaling"]
    # a team's failing HPA of the name is not ours to report (only the conflict is)
    del fake.objects[("HorizontalPodAutoscaler", "ns", "s")]
    fake.add({**foreign("HorizontalPodAutoscaler", "autoscaling/v2", {}), "status": failing})
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    degraded = conditions(fake)["Degraded"]
    assert degraded["reason"] == "NameConflict" and "FailedGetPodsMetric" not in degraded[
        "message"]


def test_two_claims_are_kept_apart_and_only_the_unwanted_one_goes(fake: FakeKube) -> None:
    """Issue 42: the KV disk tier's shared claim (`s-kv-cache`) beside the model cache's (`s`);
    children were read and kept by kind alone, so the second claim was never made."""
    model = {"uri": "hf://O/R", "revision": "main", "sizeMiB": 100,
             "cache": {"pvc": {"size": "50Gi"}}}
    body = add_server(fake, {"model": model, "kvCache": {"disk": {"size": "20Gi",
                                                                  "shared": True}}})
    handlers.reconcile(body)
    claims = {n: o for (k, _, n), o in fake.objects.items() if k == "PersistentVolumeClaim"}
    assert {n: c["spec"]["resources"]["requests"]["storage"] for n, c in claims.items()} == {
        "s": "50Gi", "s-kv-cache": "20Gi"}
    fake.writes.clear()
    body = fake.get(crd.KIND, "ns", "s")
    del body["spec"]["kvCache"]
    body["metadata"]["generation"] = 2
    handlers.reconcile(body)
    assert [w for w in fake.writes if w[1] == "PersistentVolumeClaim"] == [
        ("delete", "PersistentVolumeClaim", "s-kv-cache")]
    assert ("PersistentVolumeClaim", "ns", "s") in fake.objects
    fake.writes.clear()
    handlers.reconcile(fake.get(crd.KIND, "ns", "s"))
    assert [w for w in fake.writes if w[0] != "status"] == []  # gone is remembered as gone
