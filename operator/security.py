"""Pure: what the server's pods run as: an unprivileged user, a read-only root filesystem, no
capabilities (the restricted Pod Security Standard), for the server and its init containers."""

from __future__ import annotations

from typing import Any

UID = 10001  # the image's unprivileged user


def get_pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def get_container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}
