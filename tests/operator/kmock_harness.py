"""A Kubernetes API *emulator* for the operator's integration tests: kmock, on 127.0.0.1.

kmock (by kopf's author) serves discovery, list, watch, create, merge-patch and delete from
memory; it is not kube-apiserver. `Emulator` adds what kopf and the client rely on from a real
server: uid, creationTimestamp, resourceVersion bumped on every change, generation bumped on spec
changes, the URL's namespace in created objects, generateName, no event for a patch that
changes nothing, and a 422 for a JSON patch whose `test` fails (kmock: 500). It runs no
controllers (no Deployment controller, no garbage collector), does no defaulting, no schema or
CEL validation, no RBAC, no label-selector filtering, ignores delete preconditions, and treats
server-side apply as a merge patch. Tests may add `admission` checks:
stand-ins for validating webhooks, each told (emulator, request) before a write is stored and
raising kmock.KubernetesError to refuse it (see `keda_webhook`, and `typed_apply` for the typing
that server-side apply does). `Api` is a plain `kubernetes`
client for the tests' own calls, with its own User-Agent.

`RealCluster` is the same `Cluster` on a real API server from a kubeconfig (conftest.py's
`cluster` runs the shared tests on both): each test in a namespace of its own, watched by an
operator of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import itertools
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import kmock
import pytest
from kubernetes import client

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]

# (resource, kind, namespaced, subresources)
CORE_RESOURCES = [
    ("kvpark.io/v1alpha1/preemptservers", "PreemptServer", True, {"status", "scale"}),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("v1/services", "Service", True, {"status"}),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, {"status"}),
    ("autoscaling/v2/horizontalpodautoscalers", "HorizontalPodAutoscaler", True, {"status"}),
    ("v1/pods", "Pod", True, {"status"}),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, {"status"}),
    ("v1/configmaps", "ConfigMap", True, set()),
    ("v1/namespaces", "Namespace", False, {"status"}),
    ("v1/events", "Event", True, set()),
]
POD_MONITORS = ("monitoring.coreos.com/v1/podmonitors", "PodMonitor", True, set())
SCALED_OBJECTS = ("keda.sh/v1alpha1/scaledobjects", "ScaledObject", True, {"status"})
INFERENCE_POOLS = ("inference.networking.k8s.io/v1/inferencepools", "InferencePool", True,
                   {"status"})
ALPHA_INFERENCE_POOLS = ("inference.networking.x-k8s.io/v1alpha2/inferencepools",
                         "InferencePool", True, {"status"})
CLUSTER_PEERINGS = ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False, set())
_versions = itertools.count(1)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as kmock applies a dict patch (None deletes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def read_pointer(obj: Any, pointer: str) -> Any:
    """The value at a JSON pointer, or None where there is none."""
    for part in [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]:
        if isinstance(obj, dict):
            obj = obj.get(part)
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return None
    return obj


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Emulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.log: list[kmock.Request] = []
        self.fail_once: list[tuple[str, str]] = []  # (method, path) answered with a 500, once
        self.admission: list[Callable[[Emulator, kmock.Request], None]] = []

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # kmock matches each request against its whole history (quadratic over a test module):
        # keep the history here and only the current request there.
        self.log.append(request)
        del self._requests[:-1]
        for method, path in self.fail_once:
            if request.method == method and request.url.path == path:
                self.fail_once.remove((method, path))
                raise kmock.KubernetesError(500, "InternalError", "injected by the test")
        if request.resource is not None and request.action in (
                kmock.action.CREATE, kmock.action.UPDATE):
            for check in self.admission:
                check(self, request)
        if request.resource is not None and isinstance(request.data, list):
            self._check_json_patch_tests(request)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._on_create(request)
            elif request.action == kmock.action.UPDATE and request.name:
                unchanged = self._on_patch(request)
                if unchanged is not None:
                    return aiohttp.web.json_response(unchanged)
        return await super()._handle(request)

    def _on_create(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(_versions)),
                    creationTimestamp=_now(), generation=1)

    def _check_json_patch_tests(self, request: kmock.Request) -> None:
        """A JSON patch whose `test` fails is a 422 on kube-apiserver (checked on v1.36.2); kmock
        answers 500, which kopf retries for a minute (its finalizer removal tests the
        resourceVersion, so a status write in between made it stall)."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        stored = self.objects[key].raw
        for op in request.data:
            if isinstance(op, dict) and op.get("op") == "test" and \
                    read_pointer(stored, op.get("path", "")) != op.get("value"):
                raise kmock.KubernetesError(
                    422, "Invalid", "the server rejected our request due to an error in our "
                    "request")

    def _on_patch(self, request: kmock.Request) -> dict[str, Any] | None:
        """Stamp the patch; return the stored object instead when the patch changes nothing."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None  # kmock answers 404
        old = self.objects[key].raw
        new = merge_patch(old, request.data)
        if new == old:
            return old
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(_versions))
        if request.subresource != "status" and new.get("spec") != old.get("spec"):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        return None


def keda_webhook(emulator: Emulator, request: kmock.Request) -> None:
    """An emulation of KEDA's validating webhook (vscaledobject.kb.io), the one rule of it that
    matters here: a ScaledObject is refused while a HorizontalPodAutoscaler other than KEDA's own
    (keda-hpa-NAME) scales the same target. The real webhook answers 403 through the API server
    with this message; it runs on create and update, as here."""
    if request.resource is None or request.resource.plural != "scaledobjects":
        return
    target = ((request.data or {}).get("spec") or {}).get("scaleTargetRef") or {}
    name = (request.data.get("metadata") or {}).get("name") or request.name
    for (resource, namespace, hpa_name), obj in list(emulator.objects.items()):
        if resource.plural != "horizontalpodautoscalers" or namespace != request.namespace:
            continue
        if obj.deleted or hpa_name == f"keda-hpa-{name}":
            continue
        ref = (obj.raw.get("spec") or {}).get("scaleTargetRef") or {}
        if (ref.get("kind"), ref.get("name")) == (target.get("kind"), target.get("name")):
            raise kmock.KubernetesError(
                403, "Forbidden", 'admission webhook "vscaledobject.kb.io" denied the request: '
                f"the workload '{target.get('name')}' of type '{target.get('apiVersion')}."
                f"{target.get('kind')}' is already managed by the hpa '{hpa_name}'")


def typed_apply(emulator: Emulator, request: kmock.Request) -> None:
    """An emulation of server-side apply's first step on a Deployment: the object is typed with
    the API's schema, and a field the schema lacks or a value of another type fails the request
    with a 500, as kube-apiserver v1.36 answers it (`failed to create typed patch object (NS/NAME;
    apps/v1, Kind=Deployment): .spec.template.spec.bogusField: field not declared in schema`).
    kubernetes-validate's strict schemas do the typing here; other refusals (a missing required
    field) are the real server's 422 and not emulated."""
    import jsonschema
    import kubernetes_validate.utils as kv

    if request.resource is None or request.resource.plural != "deployments" or \
            "apply-patch" not in request.headers.get("Content-Type", ""):
        return
    try:
        kv.validate(request.data, "1.36", strict=True)
    except jsonschema.ValidationError as e:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        if e.validator == "additionalProperties":
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            why = f"{path}.{extra[0]}: field not declared in schema"
        elif e.validator in ("type", "oneOf"):
            why = f"{path}: expected {e.schema.get('type') or 'another type'}, got {e.instance!r}"
        else:
            return
        raise kmock.KubernetesError(500, "InternalError", "failed to create typed patch object ("
                                    f"{request.namespace}/{request.name}; apps/v1, "
                                    f"Kind=Deployment): {why}") from None


class KmockServer:
    """The emulator in a thread of its own, with its own event loop."""

    def __init__(self, resources: Iterable[tuple[str, str, bool, set[str]]]) -> None:
        self.resources = list(resources)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        async with Emulator() as emulator, kmock.Server(emulator) as server:
            for resource, kind, namespaced, subresources in self.resources:
                emulator.resources[resource] = kmock.ResourceInfo(
                    kind=kind, namespaced=namespaced, verbs=VERBS, subresources=subresources)
            self.emulator, self.port = emulator, server.port
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> KmockServer:
        self._thread.start()
        assert self._ready.wait(10), "kmock did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        return path

    def requests(self) -> list[kmock.Request]:
        """Every request served so far."""
        return list(self.emulator.log)


class Api:
    """The tests' own client (`kubectl`, in effect): generic paths, plain dicts."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.client = api_client
        self.client.user_agent = "kvpark-tests"

    def call(self, method: str, path: str, body: Any = None,
             content_type: str = "application/merge-patch+json") -> dict[str, Any] | None:
        request = self.client.param_serialize(
            method=method, resource_path=path, body=body, auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type})
        response = self.client.call_api(*request)
        response.read()
        try:
            return self.client.response_deserialize(response, {"2XX": "object"}).data
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def get(self, path: str) -> dict[str, Any] | None:
        return self.call("GET", path)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        created = self.call("POST", path, dict(body), content_type="application/json")
        assert created is not None
        return created

    def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        return self.call("PATCH", path, dict(body))

    def delete(self, path: str) -> dict[str, Any] | None:
        return self.call("DELETE", path, content_type="application/json")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 20.0,
             every: float = 0.05) -> T:
    """Poll `probe` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)  # a polling interval, not a synchronisation point
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


PATHS = {
    "PreemptServer": "/apis/kvpark.io/v1alpha1/namespaces/{ns}/preemptservers",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "HorizontalPodAutoscaler": "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    "ScaledObject": "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects",
    "PodMonitor": "/apis/monitoring.coreos.com/v1/namespaces/{ns}/podmonitors",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
    "InferencePool/v1alpha2":
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencepools",
}


class Cluster:
    """What a test does to the cluster, as `kubectl` would, through `Api`."""

    def __init__(self, api: Api, server: KmockServer | None = None) -> None:
        self.api = api
        self.server = server  # None on a real cluster

    @contextlib.contextmanager
    def test_namespace(self, test_name: str) -> Iterator[str]:
        """A namespace of the test's own. kmock's operator watches all namespaces and kmock
        needs none made: the name is all there is."""
        yield get_namespace_name("", test_name)

    @staticmethod
    def path(kind: str, ns: str, name: str = "", sub: str = "") -> str:
        return "/".join(p for p in (PATHS[kind].format(ns=ns), name, sub) if p)

    def create_server(self, ns: str, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": "kvpark.io/v1alpha1", "kind": "PreemptServer",
                "metadata": {"name": name, "namespace": ns}, "spec": dict(spec)}
        return self.api.create(self.path("PreemptServer", ns), body)

    def get(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        return self.api.get(self.path(kind, ns, name))

    def patch_spec(self, ns: str, name: str, spec: Mapping[str, Any]) -> None:
        self.api.patch(self.path("PreemptServer", ns, name), {"spec": dict(spec)})

    def scale(self, ns: str, name: str, replicas: int) -> None:
        self.api.patch(self.path("PreemptServer", ns, name, "scale"),
                       {"spec": {"replicas": replicas}})

    def delete(self, kind: str, ns: str, name: str) -> None:
        assert self.api.delete(self.path(kind, ns, name)) is not None, f"no {kind} {name}"

    def set_deployment_status(self, ns: str, name: str, **status: Any) -> None:
        self.api.patch(self.path("Deployment", ns, name, "status"), {"status": status})

    def wait_child(self, kind: str, ns: str, name: str,
                   check: Callable[[dict[str, Any]], bool] = bool, timeout: float = 20.0
                   ) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            obj = self.get(kind, ns, name)
            return obj if obj is not None and check(obj) else None
        return wait_for(f"{kind} {ns}/{name}", probe, timeout)

    def wait_gone(self, kind: str, ns: str, name: str, timeout: float = 20.0) -> None:
        wait_for(f"{kind} {ns}/{name} to be gone", lambda: self.get(kind, ns, name) is None,
                 timeout)

    def wait_condition(self, ns: str, name: str, type_: str, status: str,
                       reason: str | None = None, timeout: float = 20.0) -> dict[str, Any]:
        def check(server: dict[str, Any]) -> bool:
            conditions = (server.get("status") or {}).get("conditions") or []
            found = next((c for c in conditions if c["type"] == type_), None)
            return bool(found and found["status"] == status
                        and (reason is None or found["reason"] == reason))
        return self.wait_child("PreemptServer", ns, name, check, timeout)


def condition(server: Mapping[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in server["status"]["conditions"] if c["type"] == type_)


def find_helm() -> str | None:
    local = REPO / ".venv" / "bin" / "helm"
    return str(local) if local.is_file() else shutil.which("helm")


@contextlib.contextmanager
def running_operator(resources: list, workdir: Path, peering: str = "") -> Iterator[Cluster]:
    """kmock with `resources` declared, and the real operator (kopf, -A) running against it;
    with `peering`, as one of the chart's replicas (its ClusterKopfPeering made first)."""
    from kopf.testing import KopfRunner
    from kubernetes import config as kconfig

    from kvpark.operator import handlers
    from kvpark.operator.__main__ import get_kopf_args
    from kvpark.operator.config import OperatorConfig

    with KmockServer(resources) as server, operator_kubeconfig(
            str(server.write_kubeconfig(workdir / "kubeconfig"))) as kubeconfig:
        cluster = Cluster(Api(kconfig.new_client_from_config(kubeconfig)), server)
        config, saved_config = OperatorConfig(liveness="", peering=peering), handlers.CONFIG
        if peering:
            cluster.api.create("/apis/kopf.dev/v1/clusterkopfpeerings", {
                "apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                "metadata": {"name": peering}})
            handlers.CONFIG = dataclasses.replace(handlers.CONFIG, peering=peering)
        try:
            with KopfRunner(get_kopf_args(config, priority=7), timeout=30) as runner:
                yield cluster
            assert runner.exit_code == 0, runner.output[-4000:]
        finally:
            handlers.CONFIG = saved_config


def kmock_only(cluster: Cluster, why: str) -> None:
    """Skip on a real cluster a test that drives what only the emulator lets a test drive."""
    if cluster.server is None:
        pytest.skip(f"kmock only: {why}")


def get_namespace_name(prefix: str, test_name: str) -> str:
    """A DNS-1123 label from a test's name (`test_scale[kmock]` -> `scale-kmock`)."""
    name = prefix + re.sub(r"[^a-z0-9]+", "-", test_name.lower().removeprefix("test_")).strip("-")
    if len(name) > 63:  # a label's limit: a digest keeps the parameters' ids apart
        name = name[:56].rstrip("-") + "-" + hashlib.sha1(name.encode()).hexdigest()[:6]
    return name


def has_kubeconfig(kubeconfig: str) -> bool:
    return bool(kubeconfig) and all(Path(p).is_file() for p in kubeconfig.split(os.pathsep))


CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# Stand-ins for the CRDs of other projects that the operator writes to, made on a real cluster
# only where the real ones are absent (a stand-in takes any spec: the operator's objects are
# checked against the projects' own schemas in the builders' tests).
STAND_IN_CRDS = [
    ("monitoring.coreos.com", "v1", "podmonitors", "PodMonitor"),
    ("keda.sh", "v1alpha1", "scaledobjects", "ScaledObject"),
    ("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool"),
]


def get_stand_in_crd(group: str, version: str, plural: str, kind: str) -> dict[str, Any]:
    any_object = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    meta = {"name": f"{plural}.{group}", "labels": {"kvpark.io/test": "stand-in"}}  # is_stand_in
    if group.endswith(".k8s.io"):  # the API server protects these groups (KEP 1111)
        meta["annotations"] = {"api-approved.kubernetes.io": "unapproved, a test stand-in"}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": meta,
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"plural": plural, "kind": kind},
                     "versions": [{"name": version, "served": True, "storage": True,
                                   "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": any_object}}]}}


class RealCluster(Cluster):
    """A real API server from a kubeconfig. Each test gets a fresh namespace and an operator
    (kopf in-process, as the kmock tests run it) that watches only that namespace, so that on
    a shared cluster no one else's PreemptServer is reconciled; the namespace goes after."""

    def __init__(self, kubeconfig: str) -> None:
        from kubernetes import config as kconfig

        super().__init__(Api(kconfig.new_client_from_config(config_file=kubeconfig)))
        self.kubeconfig = kubeconfig
        self.run_id = uuid.uuid4().hex[:5]
        self.made_crds: list[str] = []

    def install_crds(self) -> None:
        """kvpark's CRD applied server-side (the kubeconfig needs cluster-admin-like rights),
        and the stand-ins; wait until each is Established."""
        from kvpark.operator import crd

        self.apply_crd(crd.get_crd())
        for group, version, plural, kind in STAND_IN_CRDS:
            found = self.api.get(f"{CRD_PATH}/{plural}.{group}")
            if found is None:
                self.api.create(CRD_PATH, get_stand_in_crd(group, version, plural, kind))
            if found is None or is_stand_in(found):  # or one an interrupted run left
                self.made_crds.append(f"{plural}.{group}")
        for name in [f"{crd.PLURAL}.{crd.GROUP}", *self.made_crds]:
            wait_for(f"CRD {name} to be established", lambda n=name: is_established(
                self.api.get(f"{CRD_PATH}/{n}")))

    def remove_stand_ins(self) -> None:
        for name in self.made_crds:
            self.api.delete(f"{CRD_PATH}/{name}")

    def apply_crd(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        name = body["metadata"]["name"]
        return self.api.call("PATCH", f"{CRD_PATH}/{name}?fieldManager=kvpark-tests&force=true",
                             body, content_type="application/apply-patch+yaml")

    @contextlib.contextmanager
    def test_namespace(self, test_name: str) -> Iterator[str]:
        from kopf.testing import KopfRunner

        from kvpark.operator.__main__ import get_kopf_args
        from kvpark.operator.config import OperatorConfig

        with self.namespace(test_name) as name:
            config = OperatorConfig(namespaces=(name,), liveness="")
            with operator_kubeconfig(self.kubeconfig), \
                    KopfRunner(get_kopf_args(config), timeout=60) as runner:
                yield name
            assert runner.exit_code == 0, runner.output[-4000:]

    @contextlib.contextmanager
    def namespace(self, test_name: str) -> Iterator[str]:
        """A fresh namespace named after the test and this run, deleted after."""
        name = get_namespace_name(f"kvpark-{self.run_id}-", test_name)
        self.api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": name}})
        try:
            yield name
        finally:
            self.api.delete(f"/api/v1/namespaces/{name}")


def is_stand_in(crd: Mapping[str, Any]) -> bool:
    return (crd["metadata"].get("labels") or {}).get("kvpark.io/test") == "stand-in"


def is_established(crd: Mapping[str, Any] | None) -> bool:
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


@contextlib.contextmanager
def operator_kubeconfig(kubeconfig: str) -> Iterator[str]:
    """$KUBECONFIG as the operator reads it (kube.py and kopf's login), for one block."""
    from kvpark.operator import kube

    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = kubeconfig
    kube.reset()
    try:
        yield kubeconfig
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
        kube.reset()
