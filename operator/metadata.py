"""Pure: what every child of a PreemptServer carries: its name and namespace, our labels and the
controller owner reference, and the selector that finds the server's pods."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpark.operator import crd
from kvpark.operator.config import MANAGER

APP = "kvpark-server"


def get_selector_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": name}


def get_labels(name: str) -> dict[str, str]:
    return {
        **get_selector_labels(name),
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/part-of": "kvpark",
        "app.kubernetes.io/managed-by": MANAGER,
    }


def get_selector(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(get_selector_labels(name).items()))


def get_owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """The controller reference; blockOwnerDeletion makes a foreground deletion of the
    PreemptServer wait for the child (the operator needs `update` on preemptservers/finalizers
    for it where the OwnerReferencesPermissionEnforcement admission plugin runs)."""
    meta = body["metadata"]
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def get_metadata(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    return {"name": meta["name"], "namespace": meta["namespace"],
            "labels": get_labels(meta["name"]), "ownerReferences": [get_owner_reference(body)]}
