"""spec.kvCache.disk: the prefix cache's disk tier in the pods (issue 42), as builders make it:
the server's --cache-disk flags, the kv-cache volume (one shared ReadWriteMany claim the
operator owns, or a generic ephemeral volume per pod), the longer grace period, and the checks
on the spec. End to end (kmock and a real API server) in test_operator_kmock_features.py."""

from __future__ import annotations

import kubernetes_validate.utils as kv
import pytest
from test_operator_builders import UID, build, deployment_of, server_container
from test_operator_crd import all_errors, resource

from kvpark.operator import builders, crd, kv_cache, metadata
from kvpark.operator.security import UID as SERVER_UID

MOUNT = "/var/cache/kvpark/kv"
SHARED = {"size": "50Gi", "storageClassName": "nfs-client", "shared": True,
          "writeOutSeconds": 30}
CLAIM = "llm-kv-cache"


def pod_of(spec: dict) -> dict:
    return deployment_of(spec)["spec"]["template"]["spec"]


def disk_args(container: dict) -> list[str]:
    args = container["args"]
    return [a for i, a in enumerate(args)
            if a.startswith("--cache-disk") or args[i - 1].startswith("--cache-disk")]


def test_a_shared_disk_is_one_claim_that_every_pod_mounts() -> None:
    _, _, _, children = build({"replicas": 3, "kvCache": {"disk": SHARED}})
    claim, deployment = children.apply[:2]
    assert (claim["kind"], deployment["kind"]) == ("PersistentVolumeClaim", "Deployment")
    meta = claim["metadata"]
    assert (meta["name"], meta["namespace"]) == (CLAIM, "team")
    assert meta["labels"] == metadata.get_labels("llm")
    assert meta["ownerReferences"] == [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                                        "name": "llm", "uid": UID, "controller": True,
                                        "blockOwnerDeletion": True}]  # goes with the CR
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "volumeMode": "Filesystem",
                             "resources": {"requests": {"storage": "50Gi"}},
                             "storageClassName": "nfs-client"}
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "kv-cache", "persistentVolumeClaim": {"claimName": CLAIM}} in pod["volumes"]
    assert {"name": "kv-cache", "mountPath": MOUNT} in pod["containers"][0]["volumeMounts"]
    assert disk_args(pod["containers"][0]) == ["--cache-disk", MOUNT, "--cache-disk-size",
                                               "47.50", "--cache-disk-write-out", "30"]
    assert ("v1", "PersistentVolumeClaim", CLAIM) not in children.delete
    assert ("v1", "PersistentVolumeClaim", "llm") in children.delete  # no model cache


def test_a_disk_per_pod_is_a_generic_ephemeral_volume() -> None:
    """Kubernetes names its claim <pod name>-kv-cache and the pod owns it: it outlives a
    container restart (an OOM kill), not the pod; the operator makes no claim of its own."""
    _, _, _, children = build({"kvCache": {"disk": {"size": "20Gi"}}})
    assert "PersistentVolumeClaim" not in [c["kind"] for c in children.apply]
    assert ("v1", "PersistentVolumeClaim", CLAIM) in children.delete  # one made when shared
    pod = children.apply[0]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-cache"]
    assert volume == {"name": "kv-cache", "ephemeral": {"volumeClaimTemplate": {
        "metadata": {"labels": metadata.get_selector_labels("llm")},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem",
                 "resources": {"requests": {"storage": "20Gi"}}}}}}
    assert {"name": "kv-cache", "mountPath": MOUNT} in pod["containers"][0]["volumeMounts"]
    assert disk_args(pod["containers"][0]) == ["--cache-disk", MOUNT, "--cache-disk-size",
                                               "19.00", "--cache-disk-write-out", "10"]
    classed = pod_of({"kvCache": {"disk": {"size": "20Gi", "storageClassName": "fast"}}})
    (volume,) = [v for v in classed["volumes"] if v["name"] == "kv-cache"]
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "fast"


def test_without_a_disk_nothing_of_it_is_in_the_pod() -> None:
    _, _, _, children = build({})
    pod = children.apply[0]["spec"]["template"]["spec"]
    assert disk_args(pod["containers"][0]) == []
    assert "kv-cache" not in [v["name"] for v in pod["volumes"]]
    assert MOUNT not in [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
    assert "fsGroupChangePolicy" not in pod["securityContext"]
    assert pod["terminationGracePeriodSeconds"] == builders.PRESTOP_SECONDS + 120 + \
        builders.GRACE_MARGIN_SECONDS
    assert ("v1", "PersistentVolumeClaim", CLAIM) in children.delete  # one made before goes


def test_the_grace_period_holds_the_write_out_after_the_drain() -> None:
    def grace(disk: dict) -> int:
        return pod_of({"server": {"shutdownTimeoutSeconds": 90},
                       "kvCache": {"disk": disk}})["terminationGracePeriodSeconds"]

    drain = builders.PRESTOP_SECONDS + 90 + builders.GRACE_MARGIN_SECONDS
    assert grace({"size": "1Gi", "writeOutSeconds": 45}) == drain + 45
    assert grace({"size": "1Gi"}) == drain + 10  # the default
    assert grace({"size": "1Gi", "writeOutSeconds": 0}) == drain


def test_the_pod_can_write_the_volume() -> None:
    """The root filesystem is read-only and the server runs as uid 10001: the volume is its
    own mount, not read-only, given to the pod's fsGroup (10001), which the kubelet applies only
    where the volume's top folder is not the group's yet (a shared claim keeps many files)."""
    pod = pod_of({"kvCache": {"disk": SHARED}})
    security = pod["securityContext"]
    assert security["runAsUser"] == security["fsGroup"] == SERVER_UID
    assert security["fsGroupChangePolicy"] == "OnRootMismatch"
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kv-cache"]
    assert not mount.get("readOnly")
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("size, gib", [
    ("50Gi", "47.50"), ("1Gi", "0.95"), ("100G", "88.47"), ("1.5Ti", "1459.20"),
    (107374182400, "95.00"), ("11Mi", "0.01"), ("500Gi", "475.00")])
def test_the_server_may_fill_95_percent_of_the_claim(size: str | int, gib: str) -> None:
    """Rounded down to 0.01 GiB: the filesystem's own blocks and the tier's temporary files
    need the rest."""
    assert kv_cache.get_size_gib(size) == gib
    container = server_container(deployment_of({"kvCache": {"disk": {"size": size}}}))
    assert disk_args(container)[3] == gib


def test_a_disk_too_small_for_the_tier_is_refused() -> None:
    """95% of 10Mi rounds down to 0.00 GiB, which the server refuses (--cache-disk-size > 0)."""
    (problem,) = build({"kvCache": {"disk": {"size": "10Mi"}}})[3].problems
    assert (problem.reason, problem.blocking) == ("KvCacheDiskTooSmall", True)
    assert "10Mi" in problem.message
    assert build({"kvCache": {"disk": {"size": "11Mi"}}})[3].problems == []


@pytest.mark.parametrize("args, offending", [
    (["--cache-disk", "/tmp/kv"], "--cache-disk"),
    (["--cache-disk-size=3"], "--cache-disk-size"),
    (["--cache-disk-write-out", "0"], "--cache-disk-write-out"),
])
def test_the_flags_the_disk_sets_are_refused_in_server_args(args: list, offending: str) -> None:
    (problem,) = build({"kvCache": {"disk": {"size": "1Gi"}},
                        "server": {"args": args}})[3].problems
    assert (problem.reason, problem.blocking) == ("ReservedArgument", True)
    assert offending in problem.message and "kvCache.disk" in problem.message
    # without spec.kvCache.disk they are the user's (a tier in /tmp, say)
    assert build({"server": {"args": args}})[3].problems == []


@pytest.mark.parametrize("disk", [SHARED, {"size": "20Gi", "storageClassName": "fast"}],
                         ids=["shared", "per-pod"])
@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_children_pass_the_official_schemas(disk: dict, version: str) -> None:
    spec = {"kvCache": {"disk": disk}}
    assert all_errors(resource(spec)) == set()
    for child in build(spec)[3].apply:
        if child["kind"] in ("PersistentVolumeClaim", "Deployment"):
            kv.validate(child, version, strict=True)


def test_defaults() -> None:
    spec = crd.get_spec({"spec": {"kvCache": {"disk": {"size": "1Gi"}}}})
    assert spec["kvCache"] == {"disk": {"size": "1Gi", "shared": False, "writeOutSeconds": 10}}
    assert "kvCache" not in crd.get_spec({"spec": {}})  # no disk unless asked for
    assert crd.get_spec({"spec": {"kvCache": {}}})["kvCache"] == {}


@pytest.mark.parametrize("size, refused", [
    ("0", True), ("0Gi", True), ("0.0", True), ("00.00Ti", True), ("0e3", True), ("-1Gi", True),
    (0, True), (-5, True), ("1", False), ("0.5Gi", False), (".5Ti", False), ("+1Gi", False),
    ("1e3", False), (1, False), ("10Gi", False)])
def test_the_size_must_be_greater_than_zero(size: str | int, refused: bool) -> None:
    errors = all_errors(resource({"kvCache": {"disk": {"size": size}}}))
    positive = "spec.kvCache.disk.size: must be greater than 0"
    assert (positive in errors) == refused, errors
    assert errors <= {positive, "spec.kvCache.disk.size: pattern"}
