"""Least privilege: the operator's RBAC (manifests/operator.yaml and the chart, rendered) grants
exactly the calls that operator/kube.py and kopf make, no more and no less.

The calls are recorded by kmock, a Kubernetes API *emulator* on 127.0.0.1 (kmock_harness.py),
while the real operator goes through a scenario that uses every kind of child and every verb:
create, update in place, delete (PDB, autoscalers, PodMonitor), a failed call (the operator then
posts an Event), status patches and the Deployment watch. The User-Agent tells kube.py
(`kvpark-operator/...`) from kopf (`kopf/...`).
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterable

import pytest
import yaml
from kmock_harness import (
    ALPHA_INFERENCE_POOLS,
    CLUSTER_PEERINGS,
    CORE_RESOURCES,
    INFERENCE_POOLS,
    POD_MONITORS,
    REPO,
    SCALED_OBJECTS,
    Cluster,
    running_operator,
    wait_for,
)

from kvpark.operator import handlers

Triple = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
# Granted though never called: the OwnerReferencesPermissionEnforcement admission plugin lets only
# who may update the owner's finalizers set blockOwnerDeletion in an owner reference (every child's)
AUTHORIZATION_ONLY = {("kvpark.io", "preemptservers/finalizers", "update")}
WRITE_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def expand(rules: Iterable[dict]) -> set[Triple]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def find(docs: Iterable[dict], kind: str) -> list[dict]:
    return [d for d in docs if d and d["kind"] == kind]


def called(requests: Iterable, agent: str) -> set[Triple]:
    triples = set()
    for r in requests:
        if not r.headers.get("User-Agent", "").startswith(agent) or not r.resource:
            continue
        if not r.resource.plural:
            continue  # discovery (/api, /apis/GROUP/VERSION): open to every authenticated user
        verb = WRITE_VERBS.get(str(r.method.value))
        if verb is None:
            verb = "watch" if r.params.get("watch") == "true" else "get" if r.name else "list"
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        triples.add((r.resource.group, resource, verb))
    return triples


# kmock only: the scenario's calls are read from kmock's request log, and a 500 is injected.
@pytest.fixture(scope="module")
def calls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[Triple]]:
    """Run the scenario once; the calls kube.py and kopf made, by agent."""
    resources = [*CORE_RESOURCES, POD_MONITORS, SCALED_OBJECTS, CLUSTER_PEERINGS,
                 INFERENCE_POOLS]
    with running_operator(resources, tmp_path_factory.mktemp("kmock"),
                          peering="kvpark-operator") as cluster:
        run_scenario(cluster)
        # the resync loop asked the peering object whether this replica works
        wait_for("a peering GET", lambda: ("kopf.dev", "clusterkopfpeerings", "get") in called(
            cluster.server.requests(), "kvpark-operator/"))
        requests = cluster.server.requests()
    # a cluster with only the alpha InferencePool group: the same calls there
    with running_operator([*CORE_RESOURCES, ALPHA_INFERENCE_POOLS],
                          tmp_path_factory.mktemp("kmock-alpha")) as cluster:
        run_pool_scenario(cluster, "InferencePool/v1alpha2")
        requests += cluster.server.requests()
    return {"kube.py": called(requests, "kvpark-operator/"), "kopf": called(requests, "kopf/")}


ROUTING = {"inferencePool": {"endpointPicker": {"name": "epp", "port": 9002,
                                                "failureMode": "FailClose"}}}


def run_pool_scenario(cluster: Cluster, kind: str) -> None:
    ns = "pool"
    cluster.create_server(ns, "p", {"routing": ROUTING})
    cluster.wait_child(kind, ns, "p")
    cluster.patch_spec(ns, "p", {"routing": {"inferencePool": {"endpointPicker": {
        "name": "epp2"}}}})
    cluster.wait_child(kind, ns, "p", lambda pool: "epp2" in str(pool["spec"]))
    # KV events: the picker's config as a ConfigMap, changed with the spec, gone without it
    cluster.patch_spec(ns, "p", {"routing": {"inferencePool": {"kvEvents": {
        "modelName": "m1"}}}})
    cluster.wait_child("ConfigMap", ns, "p", lambda c: "m1" in str(c["data"]))
    cluster.patch_spec(ns, "p", {"routing": {"inferencePool": {"kvEvents": {
        "modelName": "m2"}}}})
    cluster.wait_child("ConfigMap", ns, "p", lambda c: "m2" in str(c["data"]))
    cluster.patch_spec(ns, "p", {"routing": {"inferencePool": {"kvEvents": None}}})
    cluster.wait_gone("ConfigMap", ns, "p")
    cluster.patch_spec(ns, "p", {"routing": None})
    cluster.wait_gone(kind, ns, "p")


def run_scenario(cluster: Cluster) -> None:
    ns = "rbac"
    cluster.server.emulator.fail_once.append(("PATCH", cluster.path("Service", ns, "s")))
    cluster.create_server(ns, "s", {"replicas": 2, "autoscaling": {"engine": "keda",
                                                                     "maxReplicas": 3},
                                    "model": {"uri": "hf://O/R", "revision": "main", "sizeMiB": 100,
                                              "cache": {"pvc": {"size": "10Gi"}}}})
    for kind in ["Deployment", "Service", "PodDisruptionBudget", "ScaledObject", "PodMonitor",
                 "PersistentVolumeClaim"]:
        cluster.wait_child(kind, ns, "s")
    cluster.patch_spec(ns, "s", {"model": {"cache": None}})
    cluster.wait_gone("PersistentVolumeClaim", ns, "s")
    run_pool_scenario(cluster, "InferencePool")
    cluster.patch_spec(ns, "s", {"replicas": 1, "autoscaling": {"engine": "hpa"}})
    cluster.wait_child("HorizontalPodAutoscaler", ns, "s")
    cluster.wait_gone("ScaledObject", ns, "s")
    cluster.wait_gone("PodDisruptionBudget", ns, "s")
    cluster.patch_spec(ns, "s", {"autoscaling": None})
    cluster.wait_gone("HorizontalPodAutoscaler", ns, "s")
    config = handlers.CONFIG
    handlers.CONFIG = dataclasses.replace(config, pod_monitor="false")
    try:
        cluster.wait_gone("PodMonitor", ns, "s")
    finally:
        handlers.CONFIG = config
    # a PreemptServer an older operator gave kopf's finalizer: kopf takes it off (a patch)
    cluster.api.create(cluster.path("PreemptServer", ns), {
        "apiVersion": "kvpark.io/v1alpha1", "kind": "PreemptServer", "spec": {}, "metadata": {
            "name": "old", "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]}})
    cluster.wait_child("PreemptServer", ns, "old", lambda s: not s["metadata"].get("finalizers"))
    # the failed call made the operator post an Event about it
    cluster.wait_child("PreemptServer", ns, "s", lambda s: any(
        r.method == "POST" and r.resource and r.resource.plural == "events"
        for r in cluster.server.requests()))


def manifest_rules() -> set[Triple]:
    docs = list(yaml.safe_load_all((REPO / "manifests" / "operator.yaml").read_text()))
    (role,) = find(docs, "ClusterRole")
    return expand(role["rules"])


def test_manifest_rbac_is_exactly_what_kube_py_and_kopf_call(calls) -> None:
    granted = manifest_rules()
    assert calls["kube.py"] - granted == set(), "kube.py calls what the ClusterRole lacks"
    assert calls["kopf"] - granted == set(), "kopf calls what the ClusterRole lacks"
    assert granted - calls["kube.py"] - calls["kopf"] == AUTHORIZATION_ONLY, \
        "granted but never called"
    # the two halves, as the comments in the manifests explain them
    assert ("", "events", "create") in calls["kube.py"]
    assert ("kvpark.io", "preemptservers/status", "patch") in calls["kube.py"]


def render(helm: str, *args: str) -> list[dict]:
    out = subprocess.run([helm, "template", "kvpark", str(REPO / "charts" / "kvpark"),
                          "--namespace", "kvpark-system", *args],
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_chart_rbac_equals_the_manifest(helm: str) -> None:
    docs = render(helm)
    (role,) = find(docs, "ClusterRole")
    assert expand(role["rules"]) == manifest_rules()
    (binding,) = find(docs, "ClusterRoleBinding")
    (account,) = find(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "kvpark-system"}]


def test_chart_with_watched_namespaces_grants_nothing_cluster_wide(helm: str) -> None:
    docs = render(helm, "--set", "watchNamespaces={team-a,team-b}")
    assert find(docs, "ClusterRole") == [] and find(docs, "ClusterRoleBinding") == []
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    # the same, with kopf's namespaced peering objects for the cluster-wide ones
    peering = {"clusterkopfpeerings": "kopfpeerings"}
    wanted = {(g, peering.get(r, r), v) for g, r, v in manifest_rules()}
    assert all(expand(r["rules"]) == wanted for r in roles)
    assert sorted(b["metadata"]["namespace"] for b in find(docs, "RoleBinding")) == \
        ["team-a", "team-b"]
    (deployment,) = find(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPARK_WATCH_NAMESPACES"] == "team-a,team-b"


def test_the_namespaced_manifests_grant_nothing_cluster_wide() -> None:
    """Issue 38 (1.6): manifests/namespaced/ is manifests/operator.yaml with Roles in the
    namespaces it watches instead of a ClusterRole: the same rules (kopf's namespaced peering
    objects for the cluster-wide ones), bound to the same account, the same Deployment but for
    the namespaces it watches."""
    docs = [d for d in yaml.safe_load_all(
        (REPO / "manifests" / "namespaced" / "operator.yaml").read_text()) if d]
    assert find(docs, "ClusterRole") == [] and find(docs, "ClusterRoleBinding") == []
    (deployment,) = find(docs, "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    watched = next(e["value"] for e in env if e["name"] == "KVPARK_WATCH_NAMESPACES").split(",")
    roles, bindings = find(docs, "Role"), find(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(watched)
    peering = {"clusterkopfpeerings": "kopfpeerings"}
    wanted = {(g, peering.get(r, r), v) for g, r, v in manifest_rules()}
    assert all(expand(r["rules"]) == wanted for r in roles)
    (account,) = find(docs, "ServiceAccount")
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                  "namespace": account["metadata"]["namespace"]}]
               and b["roleRef"]["kind"] == "Role" for b in bindings)
    cluster_wide = list(yaml.safe_load_all((REPO / "manifests" / "operator.yaml").read_text()))
    (same,) = find(cluster_wide, "Deployment")
    for e in same["spec"]["template"]["spec"]["containers"][0]["env"]:
        if e["name"] == "KVPARK_WATCH_NAMESPACES":
            e["value"] = ",".join(watched)
    assert deployment == same
    created = {d["metadata"]["name"] for d in find(docs, "Namespace")}
    assert set(watched) <= created  # applying the folder makes what it serves
