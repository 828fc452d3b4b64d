"""spec.model.cache: an hf:// model downloaded once into a PVC that every pod mounts.

The download script runs here for real (sh, flock) with a stand-in `hf` command: two
concurrent fetches of the same folder download once, and a later one skips; what a real
ReadWriteMany volume does with flock across nodes is not verified here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate.utils as kv
import pytest
from test_operator_builders import UID, arg, build, deployment_of
from test_operator_crd import all_errors, resource

from kvpark.operator import model_source

HF = {"uri": "hf://Org/Repo/sub/q4.gguf", "revision": "0123abcd", "sizeMiB": 800}


def test_claim_the_operator_makes() -> None:
    _, _, _, children = build({"model": {**HF, "cache": {"pvc": {
        "size": "50Gi", "storageClassName": "nfs-client"}}}})
    pvc, deployment = children.apply[:2]
    assert (pvc["kind"], deployment["kind"]) == ("PersistentVolumeClaim", "Deployment")
    assert pvc["metadata"]["name"] == "llm"
    assert pvc["metadata"]["ownerReferences"][0]["uid"] == UID  # deleted with the CR
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "volumeMode": "Filesystem",
                           "resources": {"requests": {"storage": "50Gi"}},
                           "storageClassName": "nfs-client"}
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "llm"}} in pod["volumes"]
    assert ("v1", "PersistentVolumeClaim", "llm") not in children.delete


def test_existing_claim_is_mounted_not_made() -> None:
    _, _, _, children = build({"model": {**HF, "cache": {"pvc": {"claimName": "models"}}}})
    assert "PersistentVolumeClaim" not in [c["kind"] for c in children.apply]
    assert ("v1", "PersistentVolumeClaim", "llm") in children.delete  # an owned one, if any
    pod = children.apply[0]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]


def test_cached_fetch_and_server_paths() -> None:
    pod = deployment_of({"model": {**HF, "cache": {"pvc": {"claimName": "models"}}}})[
        "spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    folder = "/models/hf/Org/Repo/0123abcd"
    assert fetch["command"] == ["sh", "-c", model_source.CACHED_FETCH, "fetch-model", folder,
                                "hf", "download", "Org/Repo", "sub/q4.gguf",
                                "--revision", "0123abcd"]
    assert {"name": "model", "mountPath": "/models/hf"} in fetch["volumeMounts"]
    server = pod["containers"][0]
    assert arg(server, "--model") == f"{folder}/sub/q4.gguf"
    assert {"name": "model", "mountPath": "/models/hf", "readOnly": True} in \
        server["volumeMounts"]
    # no emptyDir for the model: nothing to ask of the node's disk for it
    assert "ephemeral-storage" not in server["resources"]["requests"]
    default = deployment_of({"model": {"uri": "hf://Org/Repo", "defaultBranch": True,
                                       "sizeMiB": 800, "cache": {"pvc": {"claimName": "m"}}}})
    (fetch,) = default["spec"]["template"]["spec"]["initContainers"]
    assert fetch["command"][4] == "/models/hf/Org/Repo/default-branch"
    assert "--revision" not in fetch["command"]


def test_default_stays_an_emptydir_per_pod() -> None:
    _, _, _, children = build({"model": HF})
    pod = children.apply[0]["spec"]["template"]["spec"]
    assert {"name": "model", "emptyDir": {"sizeLimit": "1904Mi"}} in pod["volumes"]
    assert pod["initContainers"][0]["command"][:2] == ["hf", "download"]
    assert ("v1", "PersistentVolumeClaim", "llm") in children.delete


def test_cache_applies_to_hf_models_only() -> None:
    _, _, _, children = build({"model": {"uri": "pvc://weights/m.gguf", "cache": {"pvc": {
        "size": "1Gi"}}}})  # the CRD refuses this; the builders make nothing of it either
    assert "PersistentVolumeClaim" not in [c["kind"] for c in children.apply]


@pytest.mark.parametrize("version", ["1.29", "1.33"])
@pytest.mark.parametrize("pvc", [{"size": "50Gi", "storageClassName": "nfs"},
                                 {"size": "50Gi", "accessMode": "ReadWriteOnce"},
                                 {"claimName": "models"}], ids=["made", "rwo", "existing"])
def test_children_pass_the_official_schemas(pvc: dict, version: str) -> None:
    spec = {"model": {**HF, "cache": {"pvc": pvc}}}
    assert all_errors(resource(spec)) == set()
    for child in build(spec)[3].apply:
        if child["kind"] in ("PersistentVolumeClaim", "Deployment", "Service"):
            kv.validate(child, version, strict=True)


FAKE_HF = """#!/bin/sh
# a stand-in for `hf download REPO [FILE] [--revision R] --local-dir DIR`: counts its runs
echo run >> "$COUNT"
sleep 0.5
while [ "$1" != "--local-dir" ]; do shift; done
echo weights > "$2/model.gguf"
"""


@pytest.mark.skipif(not shutil.which("flock"), reason="no flock here")
def test_concurrent_fetches_download_once(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hf").write_text(FAKE_HF)
    (bin_dir / "hf").chmod(0o755)
    folder = tmp_path / "cache" / "Org" / "Repo" / "main"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "COUNT": str(tmp_path / "count")}
    command = ["sh", "-c", model_source.CACHED_FETCH, "fetch-model", str(folder),
               "hf", "download", "Org/Repo", "--revision", "main"]
    first, second = (subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
                     for _ in range(2))
    outputs = [p.communicate(timeout=30)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0]
    assert (tmp_path / "count").read_text() == "run\n"  # one download, the other waited
    assert sum("complete in the cache" in o for o in outputs) == 1
    assert (folder / model_source.CACHE_MARKER).is_file()
    assert (folder / "model.gguf").read_text() == "weights\n"
    third = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    assert "complete in the cache" in third.stdout
    assert (tmp_path / "count").read_text() == "run\n"


@pytest.mark.skipif(not shutil.which("flock"), reason="no flock here")
def test_a_failed_download_leaves_no_marker(tmp_path: Path) -> None:
    failing = tmp_path / "hf"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    folder = tmp_path / "f"
    result = subprocess.run(["sh", "-c", model_source.CACHED_FETCH, "fetch-model", str(folder),
                             str(failing), "download", "O/R"], capture_output=True)
    assert result.returncode == 3
    assert not (folder / model_source.CACHE_MARKER).exists()


def test_the_script_is_posix_sh() -> None:
    """The image's /bin/sh is dash (Debian): no bashisms."""
    if shutil.which("dash") is None:
        pytest.skip("no dash here")
    subprocess.run(["dash", "-n", "-c", model_source.CACHED_FETCH], check=True)
