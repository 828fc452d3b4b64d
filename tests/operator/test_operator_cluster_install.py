"""kvpark installed the ways the README says, on the real API server of $KUBECONFIG (marker
`cluster`; skipped without one): the CRD through `kubectl apply` client-side and server-side,
one `kubectl apply -f manifests/` (on a cluster without kopf's peering CRDs) and the peering
object the operator makes, every example PreemptServer, and `helm install`, `upgrade` and
`uninstall` of the chart. Nothing here needs a pod to run (an image never pulled is fine); the
objects made outside a test namespace (manifests/operator.yaml's) are deleted after, the
PreemptServer CRD is kept (deleting one deletes every object of its kind)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from kmock_harness import REPO, RealCluster

from kvpark.operator import crd

pytestmark = pytest.mark.cluster
CHART = REPO / "charts" / "kvpark"
MANIFESTS = REPO / "manifests"
EXAMPLES = sorted((MANIFESTS / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def kubectl(real_cluster: RealCluster) -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("no kubectl")
    return path


def run(*args: str | Path, stdin: str | None = None) -> str:
    """A command that must succeed (its stderr in the failure); $KUBECONFIG is the cluster."""
    done = subprocess.run([str(a) for a in args], input=stdin, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{args}: {done.stderr}"
    return done.stdout


def test_kubectl_applies_the_crd_client_side_and_server_side(kubectl: str) -> None:
    """Issue 24: the API server refused the CRD (422, defaults checked unfilled against rules)."""
    for path in (MANIFESTS / "crd.yaml", CHART / "crds" / "preemptservers.yaml"):
        run(kubectl, "apply", "-f", path)
        run(kubectl, "apply", "--server-side", "--force-conflicts", "-f", path)
    run(kubectl, "wait", "--for", "condition=established", f"crd/{crd.PLURAL}.{crd.GROUP}")


PEERING_CRDS = ("crd/clusterkopfpeerings.kopf.dev", "crd/kopfpeerings.kopf.dev")


def test_one_kubectl_apply_of_the_manifests_folder_succeeds(kubectl: str,
                                                          tmp_path: Path) -> None:
    """As the README says, on a cluster without kopf's peering CRDs and from a machine that never
    asked it (kubectl's discovery cache empty, else the kind is known from an earlier visit):
    one command, exit 0. A ClusterKopfPeering in the folder failed it, its CRD not yet served
    within the same apply."""
    run(kubectl, "delete", "--ignore-not-found", "--wait=true", *PEERING_CRDS)
    try:
        run(kubectl, "apply", f"--cache-dir={tmp_path}", "-f", MANIFESTS)
        deployment = yaml.safe_load(run(kubectl, "get", "-n", "kvpark-system", "-o", "yaml",
                                        "deployment/kvpark-operator"))
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "kvpark-operator"
        run(kubectl, "apply", "-f", MANIFESTS)  # and again: nothing changes, nothing fails
    finally:
        run(kubectl, "delete", "--ignore-not-found", "--wait=false", "-f",
            MANIFESTS / "operator.yaml")


def test_the_operator_makes_its_missing_peering_object(kubectl: str) -> None:
    """The object the manifests no longer hold: created once the CRD is served, kept if there."""
    from kvpark.operator import handlers, kube

    name = "kvpark-test-peering"
    run(kubectl, "apply", "-f", MANIFESTS / "kopf-peering.yaml")
    run(kubectl, "wait", "--for", "condition=established", PEERING_CRDS[0])
    kube.reset()
    try:
        handlers.ensure_peering(name, (), wait_seconds=30)
        made = yaml.safe_load(run(kubectl, "get", "-o", "yaml", f"clusterkopfpeering/{name}"))
        assert made["metadata"]["labels"]["app.kubernetes.io/name"] == "kvpark-operator"
        handlers.ensure_peering(name, (), wait_seconds=0)  # there already: a 409, no error
    finally:
        run(kubectl, "delete", "--ignore-not-found", f"clusterkopfpeering/{name}")


def readme_servers() -> list[dict]:
    """The README's `spec:` snippets of its Kubernetes section, as PreemptServers."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Deploy on Kubernetes"):readme.index("## Where things")]
    blocks = [b.split("```")[0] for b in section.split("```yaml\n")[1:]]
    specs = [yaml.safe_load(b)["spec"] for b in blocks if b.startswith("spec:")]
    return [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
             "metadata": {"name": f"readme-{i}"}, "spec": spec} for i, spec in enumerate(specs)]


def test_every_example_preemptserver_is_accepted(kubectl: str, real_cluster: RealCluster) -> None:
    assert len(EXAMPLES) == 4
    with real_cluster.namespace("examples") as ns:
        for path in EXAMPLES:
            run(kubectl, "apply", "-n", ns, "-f", path)
        snippets = readme_servers()
        assert len(snippets) >= 5
        run(kubectl, "apply", "-n", ns, "-f", "-", stdin=yaml.safe_dump_all(snippets))
        names = run(kubectl, "get", "-n", ns, crd.PLURAL, "-o", "name").split()
        assert len(names) == len(EXAMPLES) + len(snippets)


def test_helm_installs_upgrades_and_uninstalls_the_chart(
        helm: str, kubectl: str, real_cluster: RealCluster) -> None:
    release = f"kvpark-{real_cluster.run_id}"
    with real_cluster.namespace("helm") as ns:
        run(helm, "install", release, CHART, "-n", ns, "--set", "serverImage=kvpark/kvpark:test")
        operator = real_cluster.api.get(f"/apis/apps/v1/namespaces/{ns}/deployments/"
                                        f"{release}-operator")
        assert operator["spec"]["replicas"] == 2
        run(helm, "upgrade", release, CHART, "-n", ns, "--set", "replicas=1",
            "--set", "peering=false", "--set", f"watchNamespaces={{{ns}}}")
        operator = real_cluster.api.get(f"/apis/apps/v1/namespaces/{ns}/deployments/"
                                        f"{release}-operator")
        assert operator["spec"]["replicas"] == 1
        assert real_cluster.api.get("/apis/rbac.authorization.k8s.io/v1/clusterroles/"
                                    f"{release}-operator") is None  # Roles only now
        run(helm, "uninstall", release, "-n", ns, "--wait")
        # `--wait` returns once the Deployment is gone; its pods may still be Terminating on a
        # cluster with a node (their grace period): wait for those, bounded
        selector = f"app.kubernetes.io/instance={release}"
        deadline = time.monotonic() + 120
        while run(kubectl, "get", "-n", ns, "pods", "-l", selector, "-o", "name") \
                and time.monotonic() < deadline:
            time.sleep(1)  # polling the cluster's state, bounded by the deadline
        left = run(kubectl, "get", "-n", ns, "all,roles,rolebindings,serviceaccounts,pdb",
                   "-l", selector, "-o", "name")
        assert left == ""
        assert run(helm, "list", "-n", ns, "-q") == ""
