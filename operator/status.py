"""Pure: the Deployment's state and the operator's findings -> the PreemptServer's status.

Conditions follow metav1.Condition (type, status, reason, message, observedGeneration,
lastTransitionTime); lastTransitionTime moves only when a condition's status flips.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class Problem(NamedTuple):
    """Something wrong with a spec that the schema cannot see; it makes the CR Degraded."""

    reason: str  # CamelCase, for the Degraded condition
    message: str
    blocking: bool = True  # True: children are left as they were; False: applied anyway


def format_time(now: datetime.datetime) -> str:
    return now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def get_condition(
    previous: Sequence[Mapping[str, Any]], type_: str, status: bool, reason: str, message: str,
    generation: int, now: datetime.datetime,
) -> dict[str, Any]:
    text = "True" if status else "False"
    old = next((c for c in previous if c.get("type") == type_), None)
    keep = old is not None and old.get("status") == text and old.get("lastTransitionTime")
    return {
        "type": type_,
        "status": text,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": old["lastTransitionTime"] if keep else format_time(now),
    }


# container states that will not get better by waiting
WAITING_FAILURES = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                              "CrashLoopBackOff", "CreateContainerConfigError",
                              "CreateContainerError", "RunContainerError"})


def get_readiness(desired: int, deployment: Mapping[str, Any] | None,
                  conflict: Problem | None = None) -> tuple[bool, str, str]:
    """Ready while the endpoint answers: at least one pod serves (during a scale-out or a
    rollout too, which Progressing reports). `conflict`: the Deployment of the name is not ours,
    and says nothing about this PreemptServer."""
    if conflict is not None:
        return False, conflict.reason, conflict.message
    if deployment is None:
        return False, "DeploymentMissing", "the Deployment does not exist (yet)"
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    if desired == 0:
        return False, "ScaledToZero", "replicas is 0"
    if ready >= desired:
        return True, "AllReplicasReady", f"{ready}/{desired} replicas ready"
    if ready >= 1:
        return True, "MinimumReplicasReady", f"{ready}/{desired} replicas ready"
    return False, "ReplicasNotReady", f"{ready}/{desired} replicas ready"


def needs_pods(desired: int, deployment: Mapping[str, Any] | None) -> bool:
    """Whether to look at the pods: only while some are missing (a steady state lists none)."""
    status = (deployment or {}).get("status") or {}
    counts = [int(status.get(k) or 0) for k in ("readyReplicas", "availableReplicas",
                                                 "updatedReplicas")]
    return deployment is not None and desired > 0 and min(counts) < desired


def get_pod_failure(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why a pod cannot serve, when waiting will not help: (reason, message)."""
    name = (pod.get("metadata") or {}).get("name")
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == "Unschedulable":
            return "Unschedulable", f"pod {name} cannot be scheduled: {cond.get('message', '')}"
    containers = (status.get("initContainerStatuses") or []) + \
        (status.get("containerStatuses") or [])
    for c in containers:
        state, last = c.get("state") or {}, (c.get("lastState") or {}).get("terminated") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if "OOMKilled" in (last.get("reason"), terminated.get("reason")) and not c.get("ready"):
            return "OOMKilled", (f"pod {name}: container {c.get('name')} was OOMKilled: raise "
                                 "resources.memory or lower preempt.ramMiB / contextSize")
        reason = waiting.get("reason")
        if reason == "CrashLoopBackOff":  # kubelet's message names a back-off that keeps growing
            return reason, (f"pod {name}: container {c.get('name')} keeps exiting "
                            f"({last.get('reason', 'Error')}, exit code {last.get('exitCode')})")
        if reason in WAITING_FAILURES:
            return reason, (f"pod {name}: container {c.get('name')} {reason}: "
                            f"{waiting.get('message', '')}")
    return None


def get_pod_problems(pods: Sequence[Mapping[str, Any]]) -> list[Problem]:
    """One problem per reason, naming the first pod; they make the CR Degraded at once instead
    of after the Deployment's progressDeadlineSeconds."""
    found: dict[str, list[str]] = {}
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        failure = get_pod_failure(pod)
        if failure is not None:
            found.setdefault(failure[0], []).append(failure[1])
    return [Problem(reason, messages[0] + (f" (and {len(messages) - 1} more pods)"
                                           if len(messages) > 1 else ""), blocking=False)
            for reason, messages in found.items()]


def get_progress(desired: int, deployment: Mapping[str, Any] | None,
                 failing: Sequence[Problem] = (),
                 conflict: Problem | None = None) -> tuple[bool, str, str]:
    if conflict is not None:
        return False, conflict.reason, conflict.message
    if deployment is None:
        return True, "Creating", "creating the Deployment"
    if failing:
        return False, failing[0].reason, "; ".join(p.message for p in failing)
    status = deployment.get("status") or {}
    stalled = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Progressing"
         and c.get("status") == "False"), None,
    )
    if stalled is not None:
        return False, stalled.get("reason") or "RolloutStalled", stalled.get("message") or ""
    seen = int(status.get("observedGeneration") or 0)
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    available = int(status.get("availableReplicas") or 0)
    if seen < generation:
        return True, "RolloutPending", "the Deployment controller has not seen the change yet"
    if updated < desired or total > desired or available < desired:
        return True, "RollingOut", f"{updated}/{desired} updated, {available} available"
    return False, "RolloutComplete", f"{desired} replicas on the current template"


def get_status(
    body: Mapping[str, Any],
    desired: int,
    deployment: Mapping[str, Any] | None,
    *,
    selector: str,
    endpoint: str,
    preempt_ram: int | str,
    problems: Sequence[Problem] = (),
    notes: Sequence[str] = (),
    pod_problems: Sequence[Problem] = (),
    applied: bool = True,
    conflict: Problem | None = None,
    now: datetime.datetime,
) -> dict[str, Any]:
    """The whole `.status` of a PreemptServer (the caller patches it when it differs).

    `applied`: this generation's children were all written as the spec says. Only then does
    `observedGeneration` move to it; the conditions carry the generation they judged anyway.
    `pod_problems` (get_pod_problems) stop Progressing and make the CR Degraded. `conflict`: a
    Deployment of the name that is not ours (then `deployment` is None): Ready and Progressing
    say so instead of reading someone else's rollout.
    """
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    old = body.get("status") or {}
    previous = old.get("conditions") or []
    dep_status = (deployment or {}).get("status") or {}
    ready, ready_reason, ready_message = get_readiness(desired, deployment, conflict)
    moving, move_reason, move_message = get_progress(desired, deployment, pod_problems, conflict)
    problems = [*problems, *pod_problems]
    if problems:
        degraded_reason = problems[0].reason
        degraded_message = "; ".join(p.message for p in problems)
    else:
        degraded_reason, degraded_message = "AsExpected", "the spec is served as written"
    ready_message = "; ".join([ready_message, *notes])
    conditions = [
        get_condition(previous, "Ready", ready, ready_reason, ready_message, generation, now),
        get_condition(previous, "Progressing", moving, move_reason, move_message, generation, now),
        get_condition(previous, "Degraded", bool(problems), degraded_reason, degraded_message,
                      generation, now),
    ]
    status = {
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
        "selector": selector,
        "observedGeneration": generation if applied else old.get("observedGeneration"),
        "endpoint": endpoint,
        "preemptRamMiB": preempt_ram,
        "conditions": conditions,
    }
    if status["observedGeneration"] is None:
        del status["observedGeneration"]  # nothing applied yet
    return status


# an HPA condition that is False for one of these reasons is the autoscaler doing its job: the
# target was scaled to 0 by hand, or a scale waits out its window
AUTOSCALER_QUIET = frozenset({"ScalingDisabled", "BackoffBoth", "BackoffDownscale",
                              "BackoffUpscale"})


def get_autoscaler_problems(kind: str, autoscaler: Mapping[str, Any] | None) -> list[Problem]:
    """An autoscaler of ours that cannot scale: an HPA whose AbleToScale or ScalingActive is
    False (FailedGetPodsMetric: no custom metrics API, or no series for the metric), a KEDA
    ScaledObject that is not Ready (its trigger fails). Only the HPA controller and KEDA see it
    otherwise, and the PreemptServer would never scale."""
    if autoscaler is None:
        return []
    name = (autoscaler.get("metadata") or {}).get("name")
    wanted = {"AbleToScale", "ScalingActive"} if kind == "HorizontalPodAutoscaler" else {"Ready"}
    failing = [c for c in (autoscaler.get("status") or {}).get("conditions") or []
               if c.get("type") in wanted and c.get("status") == "False"
               and c.get("reason") not in AUTOSCALER_QUIET]
    return [Problem("AutoscalerNotScaling", f"{kind} {name}: {c['type']}=False "
                    f"({c.get('reason', '')}): {c.get('message', '')}", blocking=False)
            for c in failing]


def get_new_problems(old_status: Mapping[str, Any] | None,
                     problems: Sequence[Problem]) -> list[Problem]:
    """The problems the stored Degraded condition does not say yet: each gets one Event, not
    one per reconcile."""
    degraded = next((c for c in (old_status or {}).get("conditions") or []
                     if c.get("type") == "Degraded" and c.get("status") == "True"), None)
    said = (degraded or {}).get("message") or ""
    return [p for p in problems if p.message not in said]
