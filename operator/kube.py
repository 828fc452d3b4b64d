"""The one place that talks to the Kubernetes API.

Children are written with server-side apply (field manager `kvpark-operator`, forced): a field the
operator stops setting is removed, and nothing is ever deleted to be changed. Whether a child is
the operator's to write is decided before (operator/plan.py); a delete carries the uid it was
decided for as a precondition. Every call goes through `call`, which turns 404 into None, 409
into Conflict, 400/422 into Rejected and any other refusal (403 from an admission webhook or
RBAC, 5xx) into ApiError, all with the API server's message.
The RBAC in manifests/operator.yaml and the chart grants exactly what this module (and kopf)
calls; tests/operator/test_rbac.py compares the two.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from kubernetes import client, config

from kvpark.operator import crd
from kvpark.operator.config import MANAGER

USER_AGENT = f"{MANAGER}/0.1.0"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"


class Kind(NamedTuple):
    api_version: str
    plural: str

    def path(self, namespace: str, name: str = "", subresource: str = "") -> str:
        root = "/api" if "/" not in self.api_version else "/apis"
        parts = [root, self.api_version, "namespaces", namespace, self.plural, name, subresource]
        return "/".join(p for p in parts if p)


KINDS = {
    "PreemptServer": Kind(crd.API_VERSION, crd.PLURAL),
    "Deployment": Kind("apps/v1", "deployments"),
    "Service": Kind("v1", "services"),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": Kind("autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": Kind("keda.sh/v1alpha1", "scaledobjects"),
    "PodMonitor": Kind("monitoring.coreos.com/v1", "podmonitors"),
    "PersistentVolumeClaim": Kind("v1", "persistentvolumeclaims"),
    "ConfigMap": Kind("v1", "configmaps"),
    "Pod": Kind("v1", "pods"),
    # the Gateway API Inference Extension's GA group; its alpha group serves the same plural
    "InferencePool": Kind("inference.networking.k8s.io/v1", "inferencepools"),
    "Event": Kind("v1", "events"),
}
SERVED_TTL_SECONDS = 300.0  # how long discovery answers are trusted (CRDs come and go rarely)
SERVED: dict[str, tuple[float, bool]] = {}  # "group/version/plural" -> (when asked, served)


class ApiError(Exception):
    """The API server refused a call (403, 5xx, ...); the message is its own."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}" if status else message)
        self.status = status


class Conflict(ApiError):
    """409: the object changed or already exists."""


class Rejected(ApiError):
    """400/422: the API server refused the object; the message says why."""


@functools.cache
def get_client() -> client.ApiClient:
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # $KUBECONFIG as it is now (the client library reads it once, at import)
        config.load_kube_config(os.environ.get("KUBECONFIG"), client_configuration=configuration)
    api = client.ApiClient(configuration)
    api.user_agent = USER_AGENT  # the RBAC test tells our calls from kopf's by this
    return api


def reset() -> None:
    """Forget the client and discovery (tests point the operator at another API server)."""
    get_client.cache_clear()
    SERVED.clear()


def call(method: str, path: str, *, body: Any = None, query: Iterable[tuple[str, str]] = (),
         content_type: str = "application/json") -> dict[str, Any] | None:
    api = get_client()
    request = api.param_serialize(
        method=method, resource_path=path, query_params=list(query),
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body, auth_settings=["BearerToken"],
    )
    response = api.call_api(*request)
    response.read()
    try:
        return api.response_deserialize(response, {"2XX": "object"}).data
    except client.ApiException as e:
        if e.status == 404:
            return None
        if e.status == 409:
            raise Conflict(409, get_message(e)) from e
        if e.status in (400, 422):
            raise Rejected(e.status, get_message(e)) from e
        raise ApiError(e.status, get_message(e)) from e


def get_message(error: client.ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)


def get_kind(kind: str, api_version: str = "") -> Kind:
    """`kind` at `api_version` (a kind some clusters serve in another group), else its own."""
    known = KINDS[kind]
    return Kind(api_version, known.plural) if api_version else known


def get(kind: str, namespace: str, name: str, api_version: str = "") -> dict[str, Any] | None:
    return call("GET", get_kind(kind, api_version).path(namespace, name))


def apply(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Create or update `obj` in place to what it says."""
    kind = get_kind(obj["kind"], obj["apiVersion"])
    meta = obj["metadata"]
    query = [("fieldManager", MANAGER), ("force", "true")]
    for _ in range(3):
        applied = call("PATCH", kind.path(meta["namespace"], meta["name"]), body=obj,
                       query=query, content_type=APPLY)
        if applied is not None:
            return applied
        # Only an API server that cannot create by apply answers 404 here.
        try:
            created = call("POST", kind.path(meta["namespace"]), body=obj,
                           query=[("fieldManager", MANAGER)])
        except Conflict:
            continue  # created meanwhile: apply again
        assert created is not None, f"POST {meta['name']} answered 404"
        return created
    raise Conflict(409, f"{obj['kind']} {meta['name']} kept changing while being applied")


def delete(kind: str, namespace: str, name: str, uid: str, api_version: str = "") -> bool:
    """Delete the object if it still is the one with `uid`; True when something was deleted."""
    body = {"propagationPolicy": "Background", "preconditions": {"uid": uid}}
    path = get_kind(kind, api_version).path(namespace, name)
    return call("DELETE", path, body=body) is not None


def list_objects(kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    listing = call("GET", KINDS[kind].path(namespace), query=[("labelSelector", selector)])
    return list((listing or {}).get("items") or [])


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """A core/v1 Event about the PreemptServer (`kubectl describe ps` shows it)."""
    meta = body["metadata"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1024],
        "source": {"component": MANAGER}, "reportingComponent": MANAGER,
        "reportingInstance": socket.gethostname()[:128],
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    call("POST", KINDS["Event"].path(meta["namespace"]), body=event)


def patch_status(namespace: str, name: str, status: Mapping[str, Any]) -> None:
    path = KINDS[crd.KIND].path(namespace, name, "status")
    call("PATCH", path, body={"status": status}, content_type=MERGE)


def get_served(apis: Iterable[str]) -> set[str]:
    """Which of the "group/version/plural" resources the cluster serves (discovery: no RBAC),
    asked again after SERVED_TTL_SECONDS."""
    apis, now = tuple(apis), time.monotonic()
    for api in apis:
        if api in SERVED and now - SERVED[api][0] < SERVED_TTL_SECONDS:
            continue
        group_version, _, plural = api.rpartition("/")
        listing = call("GET", f"/apis/{group_version}")
        names = {r.get("name") for r in (listing or {}).get("resources", [])}
        SERVED[api] = (now, plural in names)
    return {api for api in apis if SERVED[api][1]}
