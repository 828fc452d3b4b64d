"""spec.podTemplate: the strategic-merge-style patch (operator/podtemplate.py) and what it does to
the Deployment the builders make (checked with the official schemas, strict), and the operator's
own check of the patch against the PodSpec's schema (operator/podschema.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml
from kmock_harness import REPO
from test_operator_builders import build, deployment_of

from kvpark.operator import crd, podschema
from kvpark.operator.podtemplate import merge


def test_maps_merge_and_null_removes() -> None:
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    assert merge(base, {"a": {"c": 5, "e": 6}, "d": None}) == {"a": {"b": 1, "c": 5, "e": 6}}
    assert base == {"a": {"b": 1, "c": 2}, "d": 3}  # nothing changed in place


def test_named_lists_merge_by_their_key() -> None:
    base = {"containers": [{"name": "server", "image": "x", "env": [
        {"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}]}
    patch = {"containers": [
        {"name": "server", "env": [{"name": "B", "value": "20"}, {"name": "C", "value": "3"}],
         "volumeMounts": [{"name": "tmp", "mountPath": "/tmp", "readOnly": False},
                          {"name": "tmp", "mountPath": "/cache", "subPath": "c"}]},
        {"name": "sidecar", "image": "proxy"}]}
    merged = merge(base, patch)
    server, sidecar = merged["containers"]
    assert server["image"] == "x"
    assert server["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "20"},
                             {"name": "C", "value": "3"}]
    # volumeMounts are keyed by mountPath, as in Kubernetes: one volume, two places
    assert server["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp", "readOnly": False},
                                      {"name": "tmp", "mountPath": "/cache", "subPath": "c"}]
    assert sidecar == {"name": "sidecar", "image": "proxy"}


def test_patch_delete_removes_an_item_and_other_lists_replace() -> None:
    base = {"env": [{"name": "A"}, {"name": "B"}], "tolerations": [{"key": "gpu"}],
            "args": ["--a"]}
    merged = merge(base, {"env": [{"name": "A", "$patch": "delete"},
                                  {"name": "Z", "$patch": "delete"}],
                          "tolerations": [{"key": "spot"}], "args": ["--b"]})
    assert merged == {"env": [{"name": "B"}], "tolerations": [{"key": "spot"}], "args": ["--b"]}
    assert merge({}, {"env": [{"name": "A", "value": "1", "$patch": "merge"}]}) == {
        "env": [{"name": "A", "value": "1"}]}


PATCH = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {"sidecar.istio.io/inject": "false"}},
    "spec": {
        "priorityClassName": "inference-high",
        "runtimeClassName": "nvidia",
        "nodeSelector": {"node.kubernetes.io/instance-type": "h100"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]}]}}},
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llm"}}}],
        "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
        "containers": [
            {"name": "server",
             "env": [{"name": "SSL_CERT_DIR", "value": "/certs"}],
             "volumeMounts": [{"name": "certs", "mountPath": "/certs", "readOnly": True}]},
            {"name": "log-shipper", "image": "fluent/fluent-bit:3",
             "resources": {"limits": {"memory": "64Mi"}}},
        ],
    },
}


def test_pod_template_reaches_the_deployment() -> None:
    deployment = deployment_of({"podTemplate": PATCH, "nodeSelector": {"pool": "gpu"}})
    template = deployment["spec"]["template"]
    pod = template["spec"]
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "llm"
    assert template["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert (pod["priorityClassName"], pod["runtimeClassName"]) == ("inference-high", "nvidia")
    assert pod["nodeSelector"] == {"pool": "gpu", "node.kubernetes.io/instance-type": "h100"}
    assert pod["affinity"] == PATCH["spec"]["affinity"]
    assert pod["topologySpreadConstraints"] == PATCH["spec"]["topologySpreadConstraints"]
    assert [v["name"] for v in pod["volumes"]] == ["shm", "tmp", "certs"]
    server = pod["containers"][0]
    assert server["args"][:2] == ["--host", "0.0.0.0"]  # the operator's container, extended
    assert server["env"][-1] == {"name": "SSL_CERT_DIR", "value": "/certs"}
    assert server["env"][0]["name"] == "KVPARK_MEMORY_LIMIT"
    assert server["volumeMounts"][-1]["mountPath"] == "/certs"
    assert [c["name"] for c in pod["containers"]] == ["server", "log-shipper"]
    # the selector is untouched: the patch's labels only add to the pods
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kvpark-server", "app.kubernetes.io/instance": "llm"}
    assert build({"podTemplate": PATCH})[3].problems == []


def test_pod_template_may_override_what_the_operator_does_not_own() -> None:
    pod = deployment_of({"podTemplate": {"spec": {
        "tolerations": [{"key": "spot", "operator": "Exists"}],
        "terminationGracePeriodSeconds": 600,
        "containers": [{"name": "server", "readinessProbe": {"periodSeconds": 1}}],
    }}})["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]  # replaced
    assert pod["terminationGracePeriodSeconds"] == 600
    probe = pod["containers"][0]["readinessProbe"]
    assert probe["periodSeconds"] == 1 and probe["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("patch, reason, where", [
    ({"spec": {"containers": [{"name": "server", "image": "evil:1"}]}}, "OwnedField",
     "spec.containers[server].image"),
    ({"spec": {"containers": [{"name": "server", "args": ["--parallel", "64"]}]}},
     "OwnedField", "spec.containers[server].args"),
    ({"spec": {"containers": [{"name": "server", "command": ["sh"]}]}}, "OwnedField",
     "spec.containers[server].command"),
    ({"spec": {"containers": [{"name": "server", "resources": {"limits": {"memory": "1Gi"}}}]}},
     "OwnedField", "spec.containers[server].resources"),
    ({"spec": {"containers": [{"name": "server", "$patch": "delete"}]}}, "OwnedField",
     "spec.containers[server]"),
    ({"metadata": {"labels": {"app.kubernetes.io/instance": "other"}}}, "OwnedField",
     "metadata.labels.app.kubernetes.io/instance"),
    ({"spec": {"containers": [{"name": "server", "env": [
        {"name": "KVPARK_PARALLEL", "value": "64"}]}]}}, "ReservedArgument", "KVPARK_PARALLEL"),
])
def test_overrides_of_what_the_operator_owns_are_refused(patch: dict, reason: str,
                                                         where: str) -> None:
    (problem,) = build({"podTemplate": patch})[3].problems
    assert (problem.reason, problem.blocking) == (reason, True)
    assert where in problem.message


def test_other_containers_may_set_anything() -> None:
    patch = {"metadata": {"labels": {"app.kubernetes.io/instance": "llm"}},  # the same value
             "spec": {"containers": [{"name": "proxy", "image": "p", "args": ["-v"],
                                      "env": [{"name": "KVPARK_PARALLEL", "value": "1"}]}]}}
    assert build({"podTemplate": patch})[3].problems == []


@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_patched_deployment_passes_the_official_schema(version: str) -> None:
    kv.validate(deployment_of({"podTemplate": PATCH}), version, strict=True)


def test_a_bad_field_in_the_patch_fails_the_official_schema() -> None:
    """What the API server would refuse when the Deployment is applied (ChildRejected)."""
    deployment = deployment_of({"podTemplate": {"spec": {"priorityClass": "typo"}}})
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, "1.33", strict=True)


def test_crd_schema_takes_a_pod_template() -> None:
    schema = crd.get_openapi_schema()
    body = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"},
            "spec": {"podTemplate": PATCH}}
    jsonschema.Draft202012Validator(schema).validate(body)
    bad = {**body, "spec": {"podTemplate": {"metadata": {"labels": {"a": 1}}}}}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))


def test_the_podspec_schema_file_is_generated() -> None:
    generated = podschema.schema_yaml()
    assert podschema.SCHEMA_FILE.read_text() == generated, \
        "regenerate: python -m kvpark.operator podspec-schema > operator/podspec-schema.yaml"
    out = subprocess.run([sys.executable, "-m", "kvpark.operator", "podspec-schema"],
                         check=True, capture_output=True, text=True, cwd=REPO).stdout
    assert out == generated
    assert podschema.get_definitions()[podschema.ROOT]["additionalProperties"] is False


BAD_PATCHES = [
    ({"bogusField": 1}, "spec.podTemplate.spec.bogusField: field not declared in the schema"),
    ({"hostname": ["a"]}, "spec.podTemplate.spec.hostname: expected string, got array"),
    ({"priorityClass": "typo"}, "spec.podTemplate.spec.priorityClass: field not declared"),
    ({"terminationGracePeriodSeconds": "600"},
     "spec.podTemplate.spec.terminationGracePeriodSeconds: expected integer, got string"),
    ({"containers": [{"name": "server", "env": [{"name": "A", "valu": "1"}]}]},
     "spec.podTemplate.spec.containers[0].env[0].valu: field not declared"),
    ({"containers": [{"name": "proxy", "image": "p", "resources": {"limits": {"cpu": [1]}}}]},
     "spec.podTemplate.spec.containers[0].resources.limits.cpu: expected string or number"),
    ({"affinity": {"$patch": "replace"}},  # a directive the operator's merge does not apply
     "spec.podTemplate.spec.affinity.$patch: field not declared"),
    ({"tolerations": [{"key": "a", "$patch": "delete"}]},  # tolerations are replaced, not merged
     "spec.podTemplate.spec.tolerations[0].$patch: field not declared"),
]


@pytest.mark.parametrize("pod_spec, named", BAD_PATCHES)
def test_a_patch_the_api_server_cannot_type_is_refused_naming_the_field(pod_spec: dict,
                                                                        named: str) -> None:
    """Issue 24: server-side apply answers such a Deployment with a 500 naming no field of the
    PreemptServer. The operator refuses it first, and nothing is applied."""
    (problem,) = build({"podTemplate": {"spec": pod_spec}})[3].problems
    assert (problem.reason, problem.blocking) == ("ChildRejected", True)
    assert named in problem.message


@pytest.mark.parametrize("pod_spec, named", BAD_PATCHES[:6])
def test_what_the_check_refuses_the_official_schema_refuses(pod_spec: dict, named: str) -> None:
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment_of({"podTemplate": {"spec": pod_spec}}), "1.36", strict=True)


def test_nulls_and_delete_directives_are_no_fields() -> None:
    patch = {"spec": {"affinity": None, "hostname": None,
                      "containers": [{"name": "proxy", "$patch": "delete"}],
                      "volumes": [{"name": "tmp", "$patch": "delete"}],
                      "initContainers": [{"name": "x", "env": [{"name": "A",
                                                                "$patch": "delete"}]}]}}
    assert build({"podTemplate": patch})[3].problems == []


def test_the_readmes_pod_template_passes() -> None:
    readme = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "podTemplate" in b]
    patch = yaml.safe_load(block)["spec"]["podTemplate"]
    assert build({"podTemplate": patch})[3].problems == []
    kv.validate(deployment_of({"podTemplate": patch}), "1.36", strict=True)


def test_the_check_runs_in_the_operators_image() -> None:
    """The slim image has neither kubernetes-validate nor jsonschema; the schema ships as YAML."""
    code = ("import sys\n"
            "sys.modules['kubernetes_validate'] = sys.modules['jsonschema'] = None\n"
            "from kvpark.operator import podtemplate\n"
            "(problem,) = podtemplate.get_schema_problems({'spec': {'bogusField': 1}})\n"
            "assert 'spec.podTemplate.spec.bogusField' in problem.message\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
