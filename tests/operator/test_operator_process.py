"""`python -m kvpark.operator` as the image runs it: a separate process, configured by env,
against an EMULATED Kubernetes API (kmock on 127.0.0.1, see kmock_harness.py): it serves kopf's
liveness endpoint, reconciles, and stops cleanly on SIGTERM; and it starts from the repository
root, whose `operator/` folder would shadow the standard library's `operator`."""

from __future__ import annotations

import os
import signal
import site
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from kmock_harness import CORE_RESOURCES, REPO, Api, Cluster, KmockServer, wait_for
from kubernetes import config as kconfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


# kmock only: which namespaces the process touched is read from kmock's request log.
def test_the_operator_process(tmp_path: Path) -> None:
    with KmockServer(CORE_RESOURCES) as server:
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        liveness = f"http://127.0.0.1:{free_port()}/healthz"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPARK_LIVENESS": liveness,
               "KVPARK_WATCH_NAMESPACES": "watched", "KVPARK_SERVER_IMAGE": "example/kvpark:7"}
        log = (tmp_path / "operator.log").open("w")
        process = subprocess.Popen([sys.executable, "-m", "kvpark.operator", "--log-format=plain"],
                                   cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for("the liveness endpoint", lambda: healthy(liveness), timeout=60)
            cluster = Cluster(Api(kconfig.new_client_from_config(str(kubeconfig))), server)
            cluster.create_server("watched", "s", {})
            cluster.create_server("elsewhere", "s", {})
            deployment = cluster.wait_child("Deployment", "watched", "s", timeout=30)
            image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
            assert image == "example/kvpark:7"
            cluster.wait_child("PreemptServer", "watched", "s", lambda s: "status" in s)
            # the operator neither watched nor touched a namespace it was not given
            touched = {r.namespace for r in server.requests() if r.namespace and not
                       r.headers.get("User-Agent", "").startswith("kvpark-tests")}
            assert touched == {"watched"}
            assert cluster.get("Deployment", "elsewhere", "s") is None
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=30)
            log.close()
        output = (tmp_path / "operator.log").read_text()
        assert code == 0, output[-3000:]


def installed_layout(root: Path) -> Path:
    """kvpark laid out as its wheel installs it (pyproject's package-dir), as links to here."""
    package = root / "kvpark"
    package.mkdir(parents=True)
    (package / "__init__.py").symlink_to(REPO / "kvpark_pkg" / "__init__.py")
    for name in ("pod", "kernels", "operator"):
        (package / name).symlink_to(REPO / name, target_is_directory=True)
    return root


def test_the_operator_starts_from_the_repository_root(tmp_path: Path) -> None:
    """`python -m` puts the current directory first on sys.path: there the checkout's
    `operator/` was found as the standard library's `operator` (which runpy's own imports
    need), so it failed before kvpark ran. This venv's editable install hides that (its .pth
    imports the real one first), so a wheel's layout is used, without site's .pth files (-S)."""
    path = [str(installed_layout(tmp_path / "site")), *site.getsitepackages()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    for argv, says in ((["--help"], "Usage: kvpark-operator run"),
                       (["crd"], "kind: CustomResourceDefinition")):
        done = subprocess.run([sys.executable, "-S", "-m", "kvpark.operator", *argv], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and says in done.stdout, done.stderr[-3000:]
