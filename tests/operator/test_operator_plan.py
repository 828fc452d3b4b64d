"""Pure: wanted children + what exists -> the writes (operator/plan.py)."""

from __future__ import annotations

from kvpark.operator import crd, plan

UID = "u-1"


def owned(kind: str, uid: str = UID, name: str = "s", **spec) -> dict:
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "uid": f"{kind}-uid",
                                       "ownerReferences": [{"apiVersion": crd.API_VERSION,
                                                            "kind": crd.KIND, "name": "s",
                                                            "uid": uid, "controller": True}]},
            "spec": spec}


def test_ownership_needs_our_uid_and_controller() -> None:
    assert plan.is_owned(owned("Service"), UID)
    assert not plan.is_owned(owned("Service", uid="u-0"), UID)
    obj = owned("Service")
    obj["metadata"]["ownerReferences"][0]["controller"] = False
    assert not plan.is_owned(obj, UID)
    assert not plan.is_owned({"metadata": {"name": "s"}}, UID)


def test_subset_allows_server_defaults_but_not_changes() -> None:
    want = {"spec": {"ports": [{"port": 80}], "type": "ClusterIP"}}
    assert plan.is_subset(want, {"spec": {"ports": [{"port": 80, "protocol": "TCP"}],
                                          "type": "ClusterIP", "clusterIP": "10.0.0.1"}})
    assert not plan.is_subset(want, {"spec": {"ports": [{"port": 81}], "type": "ClusterIP"}})
    assert not plan.is_subset(want, {"spec": {"ports": [{"port": 80}, {"port": 81}],
                                              "type": "ClusterIP"}})
    # what a real API server stores for what the operator sends: no re-apply every interval
    sent = {"nodeSelector": {}, "tolerations": [], "resources": {"limits": {
        "memory": "2048Mi", "cpu": "0.5"}}, "target": {"averageValue": "0.8"}, "port": "http"}
    stored = {"resources": {"limits": {"memory": "2Gi", "cpu": "500m"}},
              "target": {"averageValue": "800m", "type": "AverageValue"}, "port": "http"}
    assert plan.is_subset(sent, stored)
    assert not plan.is_subset({"memory": "2049Mi"}, {"memory": "2Gi"})
    assert not plan.is_subset({"port": "http"}, {"port": "https"})


def test_plan_deletes_first_and_only_what_is_ours() -> None:
    wanted = [owned("Deployment", replicas=1), owned("ScaledObject", maxReplicaCount=3)]
    unwanted = [("autoscaling/v2", "HorizontalPodAutoscaler", "s"),
                ("policy/v1", "PodDisruptionBudget", "s")]
    existing = {("Deployment", "s"): None, ("ScaledObject", "s"): None,
                ("HorizontalPodAutoscaler", "s"): owned("HorizontalPodAutoscaler"),
                ("PodDisruptionBudget", "s"): owned("PodDisruptionBudget", uid="someone")}
    result = plan.get_plan(wanted, unwanted, existing, UID)
    assert [(w.verb, w.kind) for w in result.writes] == [
        ("delete", "HorizontalPodAutoscaler"), ("apply", "Deployment"), ("apply", "ScaledObject")]
    assert result.writes[0].uid == "HorizontalPodAutoscaler-uid"
    assert result.problems == []


def test_plan_reports_a_conflict_and_skips_what_it_could_not_read() -> None:
    team = {"kind": "Service", "metadata": {"name": "s", "uid": "x"}, "spec": {}}
    result = plan.get_plan([owned("Service"), owned("Deployment")], [], {("Service", "s"): team},
                           UID)
    assert result.writes == []  # Deployment: not read (an API error), left for the next time
    (problem,) = result.problems
    assert problem.reason == "NameConflict" and not problem.blocking


def test_an_unchanged_child_is_not_applied_again() -> None:
    want = plan.with_hash(owned("Service", type="ClusterIP"))
    have = {**want, "spec": {"type": "ClusterIP", "clusterIP": "10.0.0.1"}}
    assert not plan.needs_apply(want, have)
    assert plan.get_plan([owned("Service", type="ClusterIP")], [], {("Service", "s"): have},
                         UID) == plan.Plan([], [])
    stale = plan.with_hash(owned("Service", type="NodePort"))  # a field dropped since
    assert plan.needs_apply(want, {**have, "metadata": stale["metadata"]})


def test_two_children_of_a_kind_are_told_apart_by_name() -> None:
    """The model cache's claim (named like the PreemptServer) and the KV disk tier's
    (`<name>-kv-cache`): one wanted, the other ours and not wanted any more."""
    model = owned("PersistentVolumeClaim", storage="50Gi")
    kv = owned("PersistentVolumeClaim", name="s-kv-cache", storage="20Gi")
    existing = {("PersistentVolumeClaim", "s"): None, ("PersistentVolumeClaim", "s-kv-cache"): kv}
    result = plan.get_plan([model], [("v1", "PersistentVolumeClaim", "s-kv-cache")], existing, UID)
    assert [(w.verb, w.kind, w.name) for w in result.writes] == [
        ("delete", "PersistentVolumeClaim", "s-kv-cache"), ("apply", "PersistentVolumeClaim", "s")]
