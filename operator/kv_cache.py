"""Pure: `kvCache.disk` -> the prefix cache's disk tier in the pods: the server's `--cache-disk`
flags, the `kv-cache` volume and its mount, the longer grace period, and the claim behind it.

- `shared: true`: one ReadWriteMany PersistentVolumeClaim, `<name>-kv-cache`, made by the
  operator and owned by the PreemptServer (deleted with it, or by the next reconcile once
  `disk` or `shared` goes); every replica mounts it, so pages outlive pods.
- `shared: false`: a generic ephemeral volume per pod (ReadWriteOnce). Kubernetes makes its
  claim, `<pod name>-kv-cache`, owned by the pod: it lives as long as the pod (through container
  restarts), and the operator never touches it.

The server may fill 95% of the claim (`--cache-disk-size`, GiB rounded down to 0.01): the rest
is the filesystem's own blocks and the tier's temporary files before their atomic rename.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from kvpark.operator.crd import KV_CACHE_MOUNT
from kvpark.operator.metadata import get_metadata, get_selector_labels
from kvpark.operator.status import Problem

VOLUME = "kv-cache"
USABLE_PERCENT = 95
GIB = 1 << 30


def get_settings(spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """kvCache.disk with its defaults (`spec` as crd.get_spec returns it), or None."""
    return (spec.get("kvCache") or {}).get("disk")


def get_claim_name(name: str) -> str:
    """The shared claim's name (an ephemeral one is `<pod name>-kv-cache`, named alike)."""
    return f"{name}-{VOLUME}"


def get_usable_centi_gib(size: str | int) -> int:
    """What the tier may fill, in hundredths of a GiB: 95% of the claim, rounded down."""
    return math.floor(parse_quantity(size) * USABLE_PERCENT / GIB)


def get_size_gib(size: str | int) -> str:
    """--cache-disk-size: GiB with two decimals."""
    centi = get_usable_centi_gib(size)
    return f"{centi // 100}.{centi % 100:02d}"


def get_server_args(spec: Mapping[str, Any]) -> list[str]:
    settings = get_settings(spec)
    if settings is None:
        return []
    return ["--cache-disk", KV_CACHE_MOUNT,
            "--cache-disk-size", get_size_gib(settings["size"]),
            "--cache-disk-write-out", str(settings["writeOutSeconds"])]


def get_write_out_seconds(spec: Mapping[str, Any]) -> int:
    """What the grace period needs beyond the drain: the server writes pages after it."""
    settings = get_settings(spec)
    return 0 if settings is None else int(settings["writeOutSeconds"])


def get_claim_spec(settings: Mapping[str, Any], access_mode: str) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "accessModes": [access_mode],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": str(settings["size"])}},
    }
    if "storageClassName" in settings:
        claim["storageClassName"] = settings["storageClassName"]
    return claim


def get_volumes(name: str, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    settings = get_settings(spec)
    if settings is None:
        return []
    if settings["shared"]:
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": get_claim_name(name)}}]
    # the labels find a PreemptServer's claims (`kubectl get pvc -l ...`); the pod owns them
    template = {"metadata": {"labels": get_selector_labels(name)},
                "spec": get_claim_spec(settings, "ReadWriteOnce")}
    return [{"name": VOLUME, "ephemeral": {"volumeClaimTemplate": template}}]


def get_mounts(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [] if get_settings(spec) is None else [{"name": VOLUME, "mountPath": KV_CACHE_MOUNT}]


def get_pod_security(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The kubelet gives a volume to the pod's fsGroup by changing every file in it at each
    mount; the tier's folder holds many page files (and a shared claim keeps them), so only a
    volume whose top folder is not the group's yet is gone through."""
    return {} if get_settings(spec) is None else {"fsGroupChangePolicy": "OnRootMismatch"}


def get_pvc(body: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The shared claim, owned by the PreemptServer; None without `shared: true`."""
    settings = get_settings(spec)
    if settings is None or not settings["shared"]:
        return None
    metadata = {**get_metadata(body), "name": get_claim_name(body["metadata"]["name"])}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata,
            "spec": get_claim_spec(settings, "ReadWriteMany")}


def get_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """A size whose 95% rounds down to 0 GiB: the server refuses --cache-disk-size 0.00."""
    settings = get_settings(spec)
    if settings is None or get_usable_centi_gib(settings["size"]) > 0:
        return []
    return [Problem("KvCacheDiskTooSmall", f"kvCache.disk.size {settings['size']} leaves the "
                    "disk tier under 0.01 GiB (it may fill 95% of the claim): ask for more")]
