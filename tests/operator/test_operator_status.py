"""Pure status: the Deployment's state and the operator's findings -> the PreemptServer status."""

from __future__ import annotations

import datetime

import jsonschema
import pytest

from kvpark.operator import crd
from kvpark.operator.status import Problem, get_autoscaler_problems, get_status

T0 = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
T1 = T0 + datetime.timedelta(minutes=7)


def server(generation: int = 3, conditions: list | None = None) -> dict:
    body = {"metadata": {"name": "s", "namespace": "ns", "generation": generation}}
    if conditions is not None:
        body["status"] = {"conditions": conditions}
    return body


def deployment(replicas=2, ready=2, updated=2, available=2, generation=5, seen=5,
               conditions=()) -> dict:
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": seen, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "availableReplicas": available,
                       "conditions": list(conditions)}}


def status(body=None, desired=2, dep=None, now=T0, **kw) -> dict:
    return get_status(body or server(), desired, dep, selector="a=b", endpoint="http://s.ns.svc",
                      preempt_ram=kw.pop("preempt_ram", 180), now=now, **kw)


def cond(result: dict, type_: str) -> dict:
    return next(c for c in result["conditions"] if c["type"] == type_)


def test_no_deployment_yet() -> None:
    result = status()
    assert cond(result, "Ready")["status"] == "False"
    assert cond(result, "Ready")["reason"] == "DeploymentMissing"
    assert (cond(result, "Progressing")["status"], cond(result, "Progressing")["reason"]) == \
        ("True", "Creating")
    assert (result["replicas"], result["readyReplicas"]) == (0, 0)


def test_all_ready() -> None:
    result = status(dep=deployment())
    assert result == {
        "replicas": 2, "readyReplicas": 2, "selector": "a=b", "observedGeneration": 3,
        "endpoint": "http://s.ns.svc", "preemptRamMiB": 180,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AllReplicasReady",
             "message": "2/2 replicas ready", "observedGeneration": 3,
             "lastTransitionTime": "2026-01-02T03:04:05Z"},
            {"type": "Progressing", "status": "False", "reason": "RolloutComplete",
             "message": "2 replicas on the current template", "observedGeneration": 3,
             "lastTransitionTime": "2026-01-02T03:04:05Z"},
            {"type": "Degraded", "status": "False", "reason": "AsExpected",
             "message": "the spec is served as written", "observedGeneration": 3,
             "lastTransitionTime": "2026-01-02T03:04:05Z"},
        ]}


def test_rollouts() -> None:
    rolling = status(dep=deployment(replicas=3, updated=1, ready=2, available=2))
    assert cond(rolling, "Progressing")["reason"] == "RollingOut"
    assert cond(rolling, "Ready")["status"] == "True"  # 2 of 2 wanted are ready meanwhile
    pending = status(dep=deployment(generation=6, seen=5))
    assert (cond(pending, "Progressing")["status"], cond(pending, "Progressing")["reason"]) == \
        ("True", "RolloutPending")
    stalled = status(dep=deployment(ready=1, available=1, conditions=[
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": "ReplicaSet has timed out progressing."}]))
    assert (cond(stalled, "Progressing")["status"], cond(stalled, "Progressing")["reason"]) == \
        ("False", "ProgressDeadlineExceeded")
    assert cond(stalled, "Ready")["message"] == "1/2 replicas ready"


def test_ready_while_a_pod_serves() -> None:
    """Defect 9: Ready was False during every scale-out although pods served; now Ready says
    whether the endpoint answers and Progressing says the rest."""
    scaling = status(desired=3, dep=deployment(replicas=3, ready=1, available=1, updated=3))
    assert (cond(scaling, "Ready")["status"], cond(scaling, "Ready")["reason"]) == \
        ("True", "MinimumReplicasReady")
    assert cond(scaling, "Ready")["message"] == "1/3 replicas ready"
    assert (cond(scaling, "Progressing")["status"], cond(scaling, "Progressing")["reason"]) == \
        ("True", "RollingOut")
    none = status(desired=3, dep=deployment(replicas=3, ready=0, available=0, updated=3))
    assert (cond(none, "Ready")["status"], cond(none, "Ready")["reason"]) == \
        ("False", "ReplicasNotReady")


def pod(name: str, **status: object) -> dict:
    return {"metadata": {"name": name}, "status": status}


def waiting(reason: str, message: str = "", last: dict | None = None) -> dict:
    return {"name": "server", "ready": False, "state": {"waiting": {
        "reason": reason, "message": message}}, "lastState": {"terminated": last} if last else {}}


def test_pod_failures_become_problems() -> None:
    """Defect 9: what only the pods show (no GPU free, a bad image, a crash, OOM) reaches the
    status at once, not after progressDeadlineSeconds."""
    pods = [
        pod("a", conditions=[{"type": "PodScheduled", "status": "False",
                              "reason": "Unschedulable", "message": "0/3 nodes are available: "
                              "3 Insufficient nvidia.com/gpu."}]),
        pod("b", containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "x"')]),
        pod("c", initContainerStatuses=[waiting("ErrImagePull", "not found")]),
        pod("d", containerStatuses=[waiting("CrashLoopBackOff", "back-off 40s", {
            "reason": "Error", "exitCode": 2})]),
        pod("e", containerStatuses=[waiting("CrashLoopBackOff", "back-off 10s", {
            "reason": "OOMKilled", "exitCode": 137})]),
        pod("f", containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "x"')]),
        pod("g", containerStatuses=[waiting("ContainerCreating")]),  # waiting helps
        {**pod("h", containerStatuses=[waiting("CrashLoopBackOff")]),
         "metadata": {"name": "h", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
    ]
    from kvpark.operator.status import get_pod_problems
    problems = {p.reason: p.message for p in get_pod_problems(pods)}
    assert set(problems) == {"Unschedulable", "ImagePullBackOff", "ErrImagePull",
                             "CrashLoopBackOff", "OOMKilled"}
    assert "Insufficient nvidia.com/gpu" in problems["Unschedulable"]
    assert problems["ImagePullBackOff"].endswith("(and 1 more pods)")
    assert "exit code 2" in problems["CrashLoopBackOff"] and "40s" not in \
        problems["CrashLoopBackOff"]
    assert "resources.memory" in problems["OOMKilled"]
    result = status(dep=deployment(ready=1, available=1), pod_problems=get_pod_problems(pods[:1]))
    assert (cond(result, "Progressing")["status"], cond(result, "Progressing")["reason"]) == \
        ("False", "Unschedulable")
    assert (cond(result, "Degraded")["status"], cond(result, "Degraded")["reason"]) == \
        ("True", "Unschedulable")
    assert result["observedGeneration"] == 3  # the spec was applied; the pods fail


def test_scaled_to_zero_is_not_ready() -> None:
    result = status(desired=0, dep=deployment(replicas=0, ready=0, updated=0, available=0))
    assert (cond(result, "Ready")["status"], cond(result, "Ready")["reason"]) == \
        ("False", "ScaledToZero")


def test_transition_time_moves_only_when_the_status_flips() -> None:
    first = status(dep=deployment(ready=1))
    assert cond(first, "Ready")["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    # same status, other message: the time stays
    again = status(server(conditions=first["conditions"]), dep=deployment(ready=2), now=T1)
    assert cond(again, "Ready")["message"] == "2/2 replicas ready"
    assert cond(again, "Ready")["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    # the flip: a new time
    flipped = status(server(conditions=again["conditions"]), dep=deployment(ready=0), now=T1)
    assert cond(flipped, "Ready")["lastTransitionTime"] == "2026-01-02T03:11:05Z"
    assert cond(flipped, "Degraded")["lastTransitionTime"] == "2026-01-02T03:04:05Z"


def test_degraded_carries_the_first_reason_and_every_message() -> None:
    problems = [Problem("ReservedArgument", "server.args sets --port"),
                Problem("AutoscalerUnavailable", "no KEDA", blocking=False)]
    result = status(dep=deployment(), problems=problems)
    degraded = cond(result, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReservedArgument")
    assert degraded["message"] == "server.args sets --port; no KEDA"


def test_notes_go_into_the_ready_message() -> None:
    result = status(dep=deployment(), notes=["no PodMonitor: not served"])
    assert cond(result, "Ready")["message"] == "2/2 replicas ready; no PodMonitor: not served"


def test_status_fits_the_crd_schema() -> None:
    schema = crd.get_openapi_schema()["properties"]["status"]
    for result in (status(), status(dep=deployment(), problems=[Problem("X", "y")]),
                   status(dep=deployment(), preempt_ram="auto")):
        jsonschema.validate(result, schema)
        assert {c["type"] for c in result["conditions"]} == set(crd.CONDITION_TYPES)


def test_a_foreign_deployment_is_what_ready_and_progressing_say() -> None:
    """Issue 24: the status read a rollout that was not ours (`0/1 updated`)."""
    conflict = Problem("NameConflict", "Deployment s already exists, not owned by this "
                       "PreemptServer: left alone", blocking=False)
    result = status(problems=[conflict], conflict=conflict, applied=False)
    for type_ in ("Ready", "Progressing", "Degraded"):
        assert (cond(result, type_)["reason"], cond(result, type_)["message"]) == (
            "NameConflict", conflict.message)
    assert [cond(result, t)["status"] for t in ("Ready", "Progressing", "Degraded")] == [
        "False", "False", "True"]
    assert (result["replicas"], result["readyReplicas"]) == (0, 0)


def hpa(*conditions: tuple[str, str, str]) -> dict:
    return {"metadata": {"name": "s"}, "status": {"conditions": [
        {"type": t, "status": s, "reason": r, "message": f"{r} says"} for t, s, r in conditions]}}


def test_an_autoscaler_that_cannot_scale_is_a_problem() -> None:
    """Issue 24: an HPA without its metric (no custom metrics API) left the CR AsExpected."""
    (problem,) = get_autoscaler_problems("HorizontalPodAutoscaler", hpa(
        ("AbleToScale", "True", "SucceededGetScale"),
        ("ScalingActive", "False", "FailedGetPodsMetric")))
    assert problem == Problem("AutoscalerNotScaling", "HorizontalPodAutoscaler s: "
                              "ScalingActive=False (FailedGetPodsMetric): FailedGetPodsMetric "
                              "says", blocking=False)
    (problem,) = get_autoscaler_problems("HorizontalPodAutoscaler", hpa(
        ("AbleToScale", "False", "FailedGetScale")))
    assert "AbleToScale=False (FailedGetScale)" in problem.message
    (problem,) = get_autoscaler_problems("ScaledObject", hpa(("Ready", "False", "TriggerError")))
    assert problem.message.startswith("ScaledObject s: Ready=False (TriggerError)")


@pytest.mark.parametrize("kind, autoscaler", [
    ("HorizontalPodAutoscaler", None),
    ("HorizontalPodAutoscaler", {"metadata": {"name": "s"}}),  # the controller has not run yet
    ("HorizontalPodAutoscaler", hpa(("ScalingActive", "True", "ValidMetricFound"),
                                    ("ScalingLimited", "True", "TooFewReplicas"))),
    ("HorizontalPodAutoscaler", hpa(("ScalingActive", "False", "ScalingDisabled"))),  # scaled to 0
    ("ScaledObject", hpa(("Ready", "True", "ScaledObjectReady"), ("Active", "False", "NoLoad"))),
])
def test_an_autoscaler_doing_its_job_is_no_problem(kind: str, autoscaler: dict | None) -> None:
    assert get_autoscaler_problems(kind, autoscaler) == []
