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


def get_readiness(desired: int, deployment: Mapping[str, Any] | None) -> tuple[bool, str, str]:
    if deployment is None:
        return False, "DeploymentMissing", "the Deployment does not exist (yet)"
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    if desired == 0:
        return False, "ScaledToZero", "replicas is 0"
    if ready >= desired:
        return True, "AllReplicasReady", f"{ready}/{desired} replicas ready"
    return False, "ReplicasNotReady", f"{ready}/{desired} replicas ready"


def get_progress(desired: int, deployment: Mapping[str, Any] | None) -> tuple[bool, str, str]:
    if deployment is None:
        return True, "Creating", "creating the Deployment"
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
    applied: bool = True,
    now: datetime.datetime,
) -> dict[str, Any]:
    """The whole `.status` of a PreemptServer (the caller patches it when it differs).

    `applied`: this generation's children were all written as the spec says. Only then does
    `observedGeneration` move to it; the conditions carry the generation they judged anyway.
    """
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    old = body.get("status") or {}
    previous = old.get("conditions") or []
    dep_status = (deployment or {}).get("status") or {}
    ready, ready_reason, ready_message = get_readiness(desired, deployment)
    moving, move_reason, move_message = get_progress(desired, deployment)
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


def get_new_problems(old_status: Mapping[str, Any] | None,
                     problems: Sequence[Problem]) -> list[Problem]:
    """The problems the stored Degraded condition does not say yet: each gets one Event, not
    one per reconcile."""
    degraded = next((c for c in (old_status or {}).get("conditions") or []
                     if c.get("type") == "Degraded" and c.get("status") == "True"), None)
    said = (degraded or {}).get("message") or ""
    return [p for p in problems if p.message not in said]
