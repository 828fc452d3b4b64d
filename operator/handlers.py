"""kopf registrations. Each handler is a few lines; `reconcile` does the work with the pure
modules (crd, sizing, builders, plan, status) and `kube`, and is safe to run any number of times.

No finalizer: owner references make the garbage collector delete the children, so nothing has
to happen before a PreemptServer goes. kopf's `@kopf.timer` would add one
(kopf.zalando.org/KopfFinalizerMarker), which hangs CR and namespace deletion once the operator
is uninstalled; instead a watch keeps the PreemptServers it has seen (`MEMORY.servers`) and a loop
started with the operator reconciles each of them every `reconcile_seconds`.

No kopf bookkeeping in the object either: kopf's create/update handlers keep a copy of the spec
in an annotation, and a spec past the API server's 256 KiB of annotations (a large podTemplate)
made that write fail forever while the status said Ready. The reconcile is level-triggered and
reads no diff, so the event handler calls it for each new generation, labels or annotations,
and the loop retries a failed one after BACKOFF.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpark.operator import autoscaling, builders, crd, kube, metadata, peering
from kvpark.operator import plan as plan_
from kvpark.operator import sizing as sizing_
from kvpark.operator import status as status_
from kvpark.operator.config import MANAGER, OperatorConfig
from kvpark.operator.status import Problem

CONFIG = OperatorConfig.from_env()
MANAGED_BY = f"app.kubernetes.io/managed-by={MANAGER}"
OPTIONAL_APIS = (autoscaling.POD_MONITORS, autoscaling.SCALED_OBJECTS,
                *builders.INFERENCE_POOLS)
AUTOSCALERS = ("HorizontalPodAutoscaler", "ScaledObject")  # their status can make us Degraded
# kopf runs the CR's handlers, the resync loop and the Deployment watch concurrently
LOCKS: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
logger = logging.getLogger(__name__)


@dataclass
class Memory:
    """What the operator keeps between reconciles; lost on a restart, when it asks again."""

    # (namespace, name) -> the PreemptServer as the watch last saw it
    servers: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # uid -> the status last written: a handler's body may predate it
    written: dict[str, dict[str, Any]] = field(default_factory=dict)
    # uid -> the newest generation reconciled: an older body is not applied over it
    generations: dict[str, int] = field(default_factory=dict)
    # uid -> what its last successful reconcile followed (get_version); absent: retry it
    versions: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    # (uid, kind, name): children it must not have, seen absent or not its own. Only the
    # operator makes objects owned by a PreemptServer, so those stay absent and are not asked
    # again.
    absent: set[tuple[str, str, str]] = field(default_factory=set)

    def forget(self, uid: str) -> None:
        self.written.pop(uid, None)
        self.versions.pop(uid, None)
        self.generations.pop(uid, None)
        self.absent = {a for a in self.absent if a[0] != uid}


MEMORY = Memory()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # handler failures and warnings become Events on the PreemptServer (kubectl describe)
    settings.posting.loggers = True
    settings.posting.level = logging.WARNING
    # No watching of namespaces and CRDs (and no RBAC for it): install the CRD first.
    settings.scanning.disabled = True
    # the API server filters the Deployment watch: only ours reach the operator
    settings.watching.label_selectors["apps", "v1", "deployments"] = MANAGED_BY


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # as kube.py: the pod's service account, else $KUBECONFIG as it is now
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


# after a failed reconcile, retry this soon (the full resync waits reconcile_seconds)
BACKOFF = min(10.0, CONFIG.reconcile_seconds)


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
def server_event(type: str | None, body: kopf.Body, **_: Any) -> None:
    """Every event of a PreemptServer (the listing at start too): kept for the resync loop, and
    reconciled now when it says something new (not for the status writes the operator makes)."""
    key = (body.metadata.namespace, body.metadata.name)
    if type == "DELETED":
        MEMORY.servers.pop(key, None)
        MEMORY.forget(body.metadata.uid or "")
        return
    server = MEMORY.servers[key] = copy.deepcopy(dict(body))
    if get_version(server) != MEMORY.versions.get(body.metadata.uid or ""):
        reconcile_or_retry(server)


def get_version(body: Mapping[str, Any]) -> tuple[int, str, str]:
    """What a reconcile follows of the object: its spec (generation), labels and annotations."""
    meta = body["metadata"]
    return (int(meta.get("generation") or 0), repr(sorted((meta.get("labels") or {}).items())),
            repr(sorted((meta.get("annotations") or {}).items())))


def reconcile_or_retry(body: Mapping[str, Any]) -> None:
    """Reconcile; a failure leaves the version unmarked, so the resync loop tries again soon."""
    uid = body["metadata"].get("uid", "")
    MEMORY.versions.pop(uid, None)
    reconcile(body)
    MEMORY.versions[uid] = get_version(body)


PEERING_WAIT_SECONDS = 60.0  # a fresh cluster serves the peering CRDs a moment after applying


@kopf.on.startup()
async def create_peering(**_: Any) -> None:
    if CONFIG.peering:
        await asyncio.to_thread(ensure_peering, CONFIG.peering, CONFIG.namespaces)


def ensure_peering(name: str, namespaces: tuple[str, ...],
                   wait_seconds: float = PEERING_WAIT_SECONDS) -> None:
    """Create the peering objects that are missing (409: there already). A 404 means their CRD
    is not served yet (applied together with this Deployment): asked again each second for a
    while, then left to a human, since kopf keeps every replica paused without it."""
    for collection, body in peering.get_objects(name, namespaces):
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                if kube.call("POST", collection, body=body) is not None:
                    logger.info("created the peering object %s/%s", collection, name)
                    break
            except kube.Conflict:
                break
            except kube.ApiError as error:  # e.g. 403 under an older Role without `create`
                logger.warning("creating the peering object %r failed (%s); kopf keeps this "
                               "operator paused until it exists", name, error)
                break
            if time.monotonic() >= deadline:
                logger.warning("%s is not served: the peering object %r cannot be made and "
                               "kopf keeps this operator paused until it exists (apply "
                               "manifests/kopf-peering.yaml)", collection, name)
                break
            time.sleep(1.0)  # the API server publishes a new CRD within a second or two


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    memo.resync = asyncio.create_task(
        resync_forever(CONFIG.reconcile_seconds, settings.peering.priority))


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def resync_forever(interval: float, priority: int) -> None:
    """Every `interval`: reconcile each PreemptServer (brings back children deleted by hand,
    follows pods into the status), on the working replica only; every BACKOFF in between,
    those whose last reconcile failed."""
    tick = min(BACKOFF, interval)
    last_full = time.monotonic()
    while True:
        await asyncio.sleep(tick)
        if not await asyncio.to_thread(is_working, priority):
            # kopf paused this replica's watches: what it saw goes stale. When it resumes,
            # kopf lists the PreemptServers again and server_event fills this anew.
            MEMORY.servers.clear()
            continue
        full = time.monotonic() - last_full >= interval
        last_full = time.monotonic() if full else last_full
        for body in list(MEMORY.servers.values()):
            if not full and get_version(body) == MEMORY.versions.get(
                    body["metadata"].get("uid", "")):
                continue
            try:
                await asyncio.to_thread(reconcile_or_retry, body)
            except Exception:  # the next round retries; one server never stops the others
                logger.exception("reconciling %s/%s failed", body["metadata"]["namespace"],
                                 body["metadata"]["name"])


def is_working(priority: int) -> bool:
    """Whether this replica is the one kopf's peering lets work (always, standalone)."""
    if not CONFIG.peering:
        return True
    try:
        objects = [kube.call("GET", path)
                   for path in peering.get_paths(CONFIG.peering, CONFIG.namespaces)]
    except kube.ApiError:
        logger.exception("reading the peering objects failed: pausing this round")
        return False
    return peering.is_leader(objects, priority, datetime.datetime.now(datetime.timezone.utc))


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGER})
def deployment_event(body: kopf.Body, **_: Any) -> None:
    owners = body.metadata.get("ownerReferences") or []
    for owner in owners:
        if owner.get("kind") == crd.KIND and owner.get("controller"):
            server = MEMORY.servers.get((body.metadata.namespace, owner["name"]))
            if server is not None and server["metadata"].get("uid") == owner.get("uid"):
                reconcile(server)  # status follows the Deployment; a deleted one comes back


def reconcile(body: Mapping[str, Any]) -> None:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    if meta.get("deletionTimestamp"):
        return  # garbage collection takes the children
    with LOCKS[namespace, name]:
        generation = int(meta.get("generation") or 0)
        if generation < MEMORY.generations.get(uid, 0):
            return  # a body from before a newer spec was applied (the next round has it)
        MEMORY.generations[uid] = generation
        spec = crd.get_spec(body)
        sizing = sizing_.get_sizing(spec)
        served = kube.get_served(OPTIONAL_APIS)
        children = builders.get_children(body, spec, sizing, CONFIG, served)
        problems = list(children.problems)
        existing: dict[plan_.Key, dict[str, Any] | None] = {}
        if not any(p.blocking for p in problems):
            problems += sync_children(body, children, existing)
        deployment, conflict = get_own_deployment(existing, namespace, name, uid)
        applied = not problems  # before what the children report, which is no failure to apply
        problems += get_autoscaler_problems(existing, name, uid)
        selector = metadata.get_selector(name)
        pods = kube.list_objects("Pod", namespace, selector) \
            if status_.needs_pods(spec["replicas"], deployment) else []
        pod_problems = status_.get_pod_problems(pods)
        old = MEMORY.written.get(uid) or copy.deepcopy(body.get("status"))
        status = status_.get_status(
            {**body, "status": old}, spec["replicas"], deployment,
            selector=selector, endpoint=builders.get_endpoint(name, namespace),
            preempt_ram=sizing.preempt_ram, problems=problems, notes=children.notes,
            pod_problems=pod_problems, applied=applied, conflict=conflict,
            now=datetime.datetime.now(datetime.timezone.utc),
        )
        if status != old:
            kube.patch_status(namespace, name, status)
            MEMORY.written[uid] = status
        for problem in status_.get_new_problems(old, problems + pod_problems):
            kube.post_event(body, "Warning", problem.reason, problem.message)


def get_own_deployment(existing: Mapping[plan_.Key, dict[str, Any] | None], namespace: str,
                       name: str, uid: str) -> tuple[dict[str, Any] | None, Problem | None]:
    """The Deployment the status follows, or None and the conflict when the one of the name is
    someone else's (its rollout says nothing about this PreemptServer)."""
    key = ("Deployment", name)
    deployment = existing[key] if key in existing else kube.get("Deployment", namespace, name)
    if deployment is not None and not plan_.is_owned(deployment, uid):
        return None, plan_.get_conflict("Deployment", deployment)
    return deployment, None


def get_autoscaler_problems(existing: Mapping[plan_.Key, dict[str, Any] | None], name: str,
                            uid: str) -> list[Problem]:
    """What our HPA or ScaledObject, as read or applied this round, says it cannot do."""
    return [problem for kind in AUTOSCALERS
            if plan_.is_owned(existing.get((kind, name)) or {}, uid)
            for problem in status_.get_autoscaler_problems(kind, existing[kind, name])]


def sync_children(body: Mapping[str, Any], children: builders.Children,
                  existing: dict[plan_.Key, dict[str, Any] | None]) -> list[Problem]:
    """Read the children, then write only what must change (plan.py); `existing` ends up
    holding what each child is now, by (kind, name). API errors become problems: the next
    reconcile retries."""
    meta = body["metadata"]
    namespace, uid = meta["namespace"], meta["uid"]
    problems = []
    wanted = [plan_.get_key(o) for o in children.apply]
    unwanted = [(k, n) for _, k, n in children.delete if (uid, k, n) not in MEMORY.absent]
    MEMORY.absent.difference_update((uid, *key) for key in wanted)
    versions = {(k, n): v for v, k, n in children.delete} | {plan_.get_key(o): o["apiVersion"]
                                                             for o in children.apply}
    for kind, name in wanted + unwanted:
        try:
            existing[kind, name] = kube.get(kind, namespace, name,
                                            api_version=versions[kind, name])
        except kube.ApiError as e:
            problems.append(Problem("ApiError", f"reading {kind} {name}: {e}", blocking=False))
    plan = plan_.get_plan(children.apply, children.delete, existing, uid)
    for write in plan.writes:
        try:
            if write.verb == "delete":
                kube.delete(write.kind, namespace, write.name, write.uid,
                            api_version=write.api_version)
                existing[write.kind, write.name] = None
            else:
                existing[write.kind, write.name] = kube.apply(write.obj)
        except kube.Rejected as e:
            problems.append(Problem("ChildRejected", f"{write.kind}: {e}", blocking=False))
        except kube.ApiError as e:
            problems.append(Problem("ApiError", f"{write.verb} {write.kind} {write.name}: {e}",
                                    blocking=False))
    for key in unwanted:
        if key in existing and not plan_.is_owned(existing[key] or {}, uid):
            MEMORY.absent.add((uid, *key))
    return plan.problems + problems
