"""kvpark installed the ways the README says, on the real API server of $KUBECONFIG (marker
`cluster`; skipped without one): the CRD through `kubectl apply` client-side and server-side,
`kubectl apply -f manifests/`, every example PreemptServer, and `helm install`, `upgrade` and
`uninstall` of the chart. Nothing here needs a pod to run (an image never pulled is fine); the
objects made outside a test namespace (manifests/operator.yaml's) are deleted after, the CRDs
are kept (deleting one deletes every object of its kind)."""

from __future__ import annotations

import shutil
import subprocess
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


def test_kubectl_applies_the_manifests_as_the_readme_says(kubectl: str) -> None:
    try:
        run(kubectl, "apply", "-f", MANIFESTS / "crd.yaml", "-f", MANIFESTS / "kopf-peering.yaml")
        run(kubectl, "wait", "--for", "condition=established",
            "crd/clusterkopfpeerings.kopf.dev")
        run(kubectl, "apply", "-f", MANIFESTS / "operator.yaml")
        run(kubectl, "apply", "-f", MANIFESTS)  # the whole folder at once, again
        deployment = yaml.safe_load(run(kubectl, "get", "-n", "kvpark-system", "-o", "yaml",
                                        "deployment/kvpark-operator"))
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "kvpark-operator"
    finally:
        run(kubectl, "delete", "--ignore-not-found", "--wait=false", "-f",
            MANIFESTS / "operator.yaml")


def readme_servers() -> list[dict]:
    """The README's `spec:` snippets of its Kubernetes section, as PreemptServers."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Deploy on Kubernetes"):readme.index("## Where things")]
    blocks = [b.split("```")[0] for b in section.split("```yaml\n")[1:]]
    specs = [yaml.safe_load(b)["spec"] for b in blocks if b.startswith("spec:")]
    return [{"apiVersion": crd.API_VERSION, "kind": crd.KIND,
             "metadata": {"name": f"readme-{i}"}, "spec": spec} for i, spec in enumerate(specs)]


def test_every_example_preemptserver_is_accepted(kubectl: str, real_cluster: RealCluster) -> None:
    assert len(EXAMPLES) == 3
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
        left = run(kubectl, "get", "-n", ns, "all,roles,rolebindings,serviceaccounts,pdb",
                   "-l", f"app.kubernetes.io/instance={release}", "-o", "name")
        assert left == ""
        assert run(helm, "list", "-n", ns, "-q") == ""
