"""Pure: where the server's model comes from: the `--model` flag and the volumes, mounts and
init container that bring a model URI (`builtin://`, `file://`, `pvc://`, `hf://`) into the pod,
with the shared download cache of hf:// models (a PVC the operator may make)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvpark.operator import crd
from kvpark.operator.metadata import get_metadata
from kvpark.operator.security import get_container_security

MODELS_DIR = "/models"
DEFAULT_BRANCH_FOLDER = "default-branch"  # defaultBranch: true: the first download stays
# The shared cache's download: one pod at a time per folder (flock on a file in it, which NFS
# and CephFS honour across nodes), skipped once a complete download left its marker. A pod
# killed mid-download leaves no marker; the next one resumes where it stopped.
CACHE_MARKER = ".kvpark-complete"
CACHED_FETCH = f"""set -eu
folder="$1"; shift
mkdir -p "$folder"
exec 9>>"$folder/.kvpark-lock"
flock 9
if [ -f "$folder/{CACHE_MARKER}" ]; then
  echo "kvpark: $folder is complete in the cache"; exit 0
fi
"$@" --local-dir "$folder"
date -u +%Y-%m-%dT%H:%M:%SZ > "$folder/{CACHE_MARKER}"
"""


class ModelSource(NamedTuple):
    flag: str  # --model
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]


def get_model_source(name: str, spec: Mapping[str, Any], image: str) -> ModelSource:
    model = spec["model"]
    uri: str = model["uri"]
    if uri.startswith("file://"):
        return ModelSource(uri.removeprefix("file://"), [], [], [])
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        mount = f"{MODELS_DIR}/pvc"
        return ModelSource(
            f"{mount}/{path}".rstrip("/"),
            [{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            [{"name": "model", "mountPath": mount, "readOnly": True}],
            [],
        )
    if uri.startswith("hf://"):
        org, repo, *rest = uri.removeprefix("hf://").split("/")
        mount = f"{MODELS_DIR}/hf"
        path = "/".join(rest)
        claim = get_cache_claim(name, model)
        if claim is None:
            return ModelSource(
                f"{mount}/{path}".rstrip("/"),
                [{"name": "model", "emptyDir": {"sizeLimit": get_download_size(model)}}],
                [{"name": "model", "mountPath": mount, "readOnly": True}],
                [get_fetch_container(model, f"{org}/{repo}", path, mount, image, spec)],
            )
        # one folder per repository and revision: PreemptServers may share a claim
        folder = f"{mount}/{org}/{repo}/{model.get('revision', DEFAULT_BRANCH_FOLDER)}"
        return ModelSource(
            f"{folder}/{path}".rstrip("/"),
            [{"name": "model", "persistentVolumeClaim": {"claimName": claim}}],
            [{"name": "model", "mountPath": mount, "readOnly": True}],
            [get_fetch_container(model, f"{org}/{repo}", path, folder, image, spec,
                                 cached=True, mount=mount)],
        )
    return ModelSource(uri, [], [], [])  # builtin://


def get_cache_claim(name: str, model: Mapping[str, Any]) -> str | None:
    """The PVC of an hf:// model's shared cache: the user's claim, or the one the operator makes
    (named like the PreemptServer); None: an emptyDir per pod."""
    pvc = (model.get("cache") or {}).get("pvc")
    if pvc is None:
        return None
    return str(pvc.get("claimName") or name)


def get_cache_pvc(body: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The cache PVC the operator makes (cache.pvc.size given), owned by the PreemptServer: it
    goes with it (name an existing claimName to keep the cache)."""
    pvc = (spec["model"].get("cache") or {}).get("pvc") or {}
    if not spec["model"]["uri"].startswith("hf://") or "size" not in pvc:
        return None
    claim: dict[str, Any] = {
        "accessModes": [pvc["accessMode"]],
        "volumeMode": "Filesystem",
        "resources": {"requests": {"storage": str(pvc["size"])}},
    }
    if "storageClassName" in pvc:
        claim["storageClassName"] = pvc["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": get_metadata(body),
            "spec": claim}


def get_download_size(model: Mapping[str, Any]) -> str:
    """hf:// models: how much the model emptyDir may hold (the kubelet evicts a pod above)."""
    if "downloadSize" in model:
        return str(model["downloadSize"])
    if "sizeMiB" in model:
        return f"{math.ceil(model['sizeMiB'] * 11 / 10) + 1024}Mi"
    return crd.DEFAULT_DOWNLOAD_SIZE


def get_fetch_container(model: Mapping[str, Any], repo: str, path: str, folder: str, image: str,
                        spec: Mapping[str, Any], cached: bool = False,
                        mount: str = "") -> dict[str, Any]:
    download = ["hf", "download", repo, *([path] if path else [])]
    revision = ["--revision", model["revision"]] if "revision" in model else []
    if cached:
        command = ["sh", "-c", CACHED_FETCH, "fetch-model", folder, *download, *revision]
    else:
        command = [*download, "--local-dir", folder, *revision]
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"},
           {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    if "hfTokenSecretRef" in model:
        ref = model["hfTokenSecretRef"]
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": ref["name"], "key": ref.get("key", "token")}}})
    container = {
        "name": "fetch-model",
        "image": image,
        "command": command,
        "env": env,
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "securityContext": get_container_security(),
        "volumeMounts": [{"name": "model", "mountPath": mount or folder},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    if "imagePullPolicy" in spec:
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container
