"""kopf registrations. Each handler is a few lines; `reconcile` does the work with the pure
modules (crd, sizing, builders, status) and `kube`, and is safe to run any number of times."""

from __future__ import annotations

import copy
import datetime
import logging
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import kopf

from kvpark.operator import builders, crd, kube
from kvpark.operator import plan as plan_
from kvpark.operator import sizing as sizing_
from kvpark.operator import status as status_
from kvpark.operator.config import MANAGER, OperatorConfig
from kvpark.operator.status import Problem

CONFIG = OperatorConfig.from_env()
OPTIONAL_APIS = (builders.POD_MONITORS, builders.SCALED_OBJECTS)
# kopf runs the CR's handlers, its timer and the Deployment watch concurrently
LOCKS: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
# (PreemptServer uid, kind): children it must not have, seen absent (or not its own). Only the
# operator makes objects owned by a PreemptServer, so they stay absent and are not asked again.
ABSENT: set[tuple[str, str]] = set()
# PreemptServer uid -> the status last written: the bodies handlers get may predate it
WRITTEN: dict[str, dict[str, Any]] = {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP)
    # handler failures and warnings become Events on the PreemptServer (kubectl describe)
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    # No watching of namespaces and CRDs (and no RBAC for it): install the CRD first.
    settings.scanning.disabled = True


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # as kube.py: the pod's service account, else $KUBECONFIG as it is now
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


# after an API error, retry soon (kopf's default waits 60 s, also for the timer)
BACKOFF = min(10.0, CONFIG.reconcile_seconds)


@kopf.on.resume(crd.GROUP, crd.VERSION, crd.PLURAL, backoff=BACKOFF)
@kopf.on.create(crd.GROUP, crd.VERSION, crd.PLURAL, backoff=BACKOFF)
@kopf.on.update(crd.GROUP, crd.VERSION, crd.PLURAL, backoff=BACKOFF)
def server_changed(body: kopf.Body, **_: Any) -> None:
    reconcile(body)


@kopf.timer(crd.GROUP, crd.VERSION, crd.PLURAL, interval=CONFIG.reconcile_seconds,
            backoff=BACKOFF)
def server_timer(body: kopf.Body, **_: Any) -> None:
    reconcile(body)  # brings back children deleted by hand


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGER})
def deployment_event(body: kopf.Body, **_: Any) -> None:
    owners = body.metadata.get("ownerReferences") or []
    for owner in owners:
        if owner.get("kind") == crd.KIND and owner.get("controller"):
            server = kube.get(crd.KIND, body.metadata.namespace, owner["name"])
            if server is not None:
                reconcile(server)  # status follows the Deployment; a deleted one comes back


def reconcile(body: Mapping[str, Any]) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if meta.get("deletionTimestamp"):
        return  # garbage collection takes the children
    with LOCKS[namespace, name]:
        spec = crd.get_spec(body)
        sizing = sizing_.get_sizing(spec)
        served = kube.get_served(OPTIONAL_APIS)
        children = builders.get_children(body, spec, sizing, CONFIG, served)
        problems = list(children.problems)
        existing: dict[str, dict[str, Any] | None] = {}
        if not any(p.blocking for p in problems):
            problems += sync_children(body, children, existing)
        deployment = existing["Deployment"] if "Deployment" in existing else \
            kube.get("Deployment", namespace, name)
        old = WRITTEN.get(meta["uid"]) or copy.deepcopy(body.get("status"))
        status = status_.get_status(
            {**body, "status": old}, spec["replicas"], deployment,
            selector=builders.get_selector(name), endpoint=builders.get_endpoint(name, namespace),
            preempt_ram=sizing.preempt_ram, problems=problems, notes=children.notes,
            applied=not problems, now=datetime.datetime.now(datetime.timezone.utc),
        )
        if status != old:
            kube.patch_status(namespace, name, status)
            WRITTEN[meta["uid"]] = status
        for problem in status_.get_new_problems(old, problems):
            kube.post_event(body, "Warning", problem.reason, problem.message)


def sync_children(body: Mapping[str, Any], children: builders.Children,
                  existing: dict[str, dict[str, Any] | None]) -> list[Problem]:
    """Read the children, then write only what must change (plan.py); `existing` ends up
    holding what each child is now. API errors become problems: the next reconcile retries."""
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    problems = []
    wanted = [o["kind"] for o in children.apply]
    unwanted = [k for _, k, _ in children.delete if (uid, k) not in ABSENT]
    ABSENT.difference_update((uid, kind) for kind in wanted)
    for kind in wanted + unwanted:
        try:
            existing[kind] = kube.get(kind, namespace, name)
        except kube.ApiError as e:
            problems.append(Problem("ApiError", f"reading {kind} {name}: {e}", blocking=False))
    plan = plan_.get_plan(children.apply, children.delete, existing, uid)
    for write in plan.writes:
        try:
            if write.verb == "delete":
                kube.delete(write.kind, namespace, write.name, write.uid)
                existing[write.kind] = None
            else:
                existing[write.kind] = kube.apply(write.obj)
        except kube.Rejected as e:
            problems.append(Problem("ChildRejected", f"{write.kind}: {e}", blocking=False))
        except kube.ApiError as e:
            problems.append(Problem("ApiError", f"{write.verb} {write.kind} {write.name}: {e}",
                                    blocking=False))
    for kind in unwanted:
        if kind in existing and not plan_.is_owned(existing[kind] or {}, uid):
            ABSENT.add((uid, kind))
    return plan.problems + problems
