"""The PreemptServer CRD: generated YAML in sync, and its schema judging good and bad resources.

Structural checks run with jsonschema against the CRD's openAPIV3Schema; the CEL rules
(x-kubernetes-validations) run with cel-python after the schema's defaults are applied, as the
API server does. A real API server also type-checks and costs the CEL at CRD creation: that part
is only exercised by the `cluster`-marked test.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from kmock_harness import REPO

from kvpark.operator import crd
from kvpark.operator.__main__ import main

SCHEMA = crd.get_openapi_schema()
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
CEL = celpy.Environment()


def schema_errors(obj: dict) -> set[str]:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    return {".".join(str(p) for p in e.absolute_path) + f": {e.validator}"
            for e in validator.iter_errors(obj)}


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> set[str]:
    errors = set()
    for rule in schema.get("x-kubernetes-validations", []):
        program = CEL.program(CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        assert isinstance(result, celpy.celtypes.BoolType), f"{rule['rule']} gave {result!r}"
        if not result:
            errors.add(f"{path}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value and value[key] is not None:
                errors |= cel_errors(sub, value[key], f"{path}.{key}".lstrip("."))
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors |= cel_errors(schema["items"], item, f"{path}.{i}")
    return errors


def all_errors(obj: dict) -> set[str]:
    errors = schema_errors(obj)
    if errors:
        return errors  # the API server stops at the structural errors too
    return cel_errors(SCHEMA, crd.with_defaults(SCHEMA, obj))


def resource(spec: dict) -> dict:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"},
            "spec": spec}


def test_manifest_and_chart_crds_are_generated() -> None:
    generated = crd.crd_yaml()
    assert (REPO / "manifests" / "crd.yaml").read_text() == generated, \
        "regenerate: python -m kvpark.operator crd > manifests/crd.yaml"
    assert (REPO / "charts" / "kvpark" / "crds" / "preemptservers.yaml").read_text() == generated
    assert yaml.safe_load(generated) == crd.get_crd()


def test_the_crd_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd.crd_yaml()
    out = subprocess.run([sys.executable, "-m", "kvpark.operator", "crd"], check=True,
                         capture_output=True, text=True, cwd=REPO).stdout
    assert out == (REPO / "manifests" / "crd.yaml").read_text()


def test_names_subresources_and_columns() -> None:
    spec = crd.get_crd()["spec"]
    assert (spec["group"], spec["scope"]) == ("kvpark.io", "Namespaced")
    assert spec["names"]["kind"] == "PreemptServer" and spec["names"]["shortNames"] == ["ps"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]
               if c.get("priority", 0) == 0]
    assert columns == ["Ready", "Replicas", "Parallel", "Preempt RAM", "Endpoint", "Age"]


def test_every_cel_rule_compiles() -> None:
    def rules(schema: dict) -> list[str]:
        found = [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
        for sub in schema.get("properties", {}).values():
            found += rules(sub)
        return found + (rules(schema["items"]) if "items" in schema else [])

    found = rules(SCHEMA)
    assert len(found) >= 7
    for rule in found:
        CEL.compile(rule)


def test_defaults() -> None:
    spec = crd.get_spec({"spec": {"autoscaling": {"maxReplicas": 3}}})
    assert spec["model"] == {"uri": "builtin://smollm2-135m"}
    assert (spec["replicas"], spec["parallel"], spec["contextSize"], spec["pageSize"]) == \
        (1, 4, 8192, 16)
    assert spec["preempt"] == {"enabled": True, "ramMiB": "auto"}
    assert spec["resources"] == {"gpus": 1}
    assert spec["autoscaling"] == {"maxReplicas": 3, "minReplicas": 1, "engine": "hpa",
                                   "target": {"signal": "parkedRequests"}}
    assert spec["server"] == {"shutdownTimeoutSeconds": 120}
    assert "autoscaling" not in crd.get_spec({"spec": {}})  # only inside objects present


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    (obj,) = list(yaml.safe_load_all(path.read_text()))
    assert (obj["apiVersion"], obj["kind"]) == (crd.API_VERSION, crd.KIND)
    assert all_errors(obj) == set()


def test_the_three_examples_exist() -> None:
    specs = {p.stem: yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES}
    assert set(specs) == {"minimal", "gpu-autoscaling", "cpu"}
    assert specs["minimal"] == {}
    assert specs["gpu-autoscaling"]["resources"]["gpus"] >= 1
    assert "autoscaling" in specs["gpu-autoscaling"]
    assert specs["cpu"]["resources"]["gpus"] == 0


BAD = [
    ("zero slots", {"parallel": 0}, "spec.parallel: minimum"),
    ("negative replicas", {"replicas": -1}, "spec.replicas: minimum"),
    ("more than one gpu", {"resources": {"gpus": 2}}, "spec.resources.gpus: maximum"),
    ("unknown scheme", {"model": {"uri": "s3://bucket/model"}}, "spec.model.uri: pattern"),
    ("hf without revision", {"model": {"uri": "hf://org/repo"}},
     "spec.model: an hf:// model must name a revision or set defaultBranch: true"),
    ("hf with both", {"model": {"uri": "hf://org/repo", "revision": "v1", "defaultBranch": True}},
     "spec.model: revision and defaultBranch: true exclude each other"),
    ("revision off hf", {"model": {"uri": "pvc://c/m.gguf", "revision": "v1"}},
     "spec.model: revision, defaultBranch, hfTokenSecretRef, downloadSize and cache apply to "
     "hf:// models only"),
    ("download size off hf", {"model": {"uri": "pvc://c/m.gguf", "downloadSize": "1Gi"}},
     "spec.model: revision, defaultBranch, hfTokenSecretRef, downloadSize and cache apply to "
     "hf:// models only"),
    ("cache off hf", {"model": {"uri": "pvc://c/m.gguf", "cache": {"pvc": {"claimName": "c"}}}},
     "spec.model: revision, defaultBranch, hfTokenSecretRef, downloadSize and cache apply to "
     "hf:// models only"),
    ("cache and download size", {"model": {"uri": "hf://O/R", "revision": "main",
                                           "downloadSize": "1Gi",
                                           "cache": {"pvc": {"claimName": "c"}}}},
     "spec.model: downloadSize sizes the per-pod emptyDir; with a cache, cache.pvc.size sizes "
     "the claim"),
    ("cache claim and size", {"model": {"uri": "hf://O/R", "revision": "main",
                                        "cache": {"pvc": {"claimName": "c", "size": "1Gi"}}}},
     "spec.model.cache.pvc: set either claimName or size"),
    ("cache neither", {"model": {"uri": "hf://O/R", "revision": "main",
                                 "cache": {"pvc": {"accessMode": "ReadWriteOnce"}}}},
     "spec.model.cache.pvc: set either claimName or size"),
    ("cache class with claim", {"model": {"uri": "hf://O/R", "revision": "main", "cache": {
        "pvc": {"claimName": "c", "storageClassName": "nfs"}}}},
     "spec.model.cache.pvc: storageClassName applies with size only"),
    ("cache access mode", {"model": {"uri": "hf://O/R", "revision": "main", "cache": {
        "pvc": {"size": "1Gi", "accessMode": "ReadOnlyMany"}}}},
     "spec.model.cache.pvc.accessMode: enum"),
    ("no rollout can move", {"strategy": {"maxSurge": 0, "maxUnavailable": "0%"}},
     "spec.strategy: maxSurge and maxUnavailable may not both be 0"),
    ("negative surge", {"strategy": {"maxSurge": -1}},
     "spec.strategy.maxSurge: must be an integer >= 0 or a percentage such as 25%"),
    ("surge word", {"strategy": {"maxSurge": "lots"}},
     "spec.strategy.maxSurge: must be an integer >= 0 or a percentage such as 25%"),
    ("unknown strategy", {"strategy": {"type": "BlueGreen"}}, "spec.strategy.type: enum"),
    ("min above max", {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "spec.autoscaling: minReplicas must be <= maxReplicas"),
    ("no max", {"autoscaling": {"minReplicas": 1}}, "spec.autoscaling: required"),
    ("unknown engine", {"autoscaling": {"maxReplicas": 2, "engine": "vpa"}},
     "spec.autoscaling.engine: enum"),
    ("unknown signal", {"autoscaling": {"maxReplicas": 2, "target": {"signal": "latency"}}},
     "spec.autoscaling.target.signal: enum"),
    ("bad threshold", {"autoscaling": {"maxReplicas": 2, "target": {"averageValue": "lots"}}},
     "spec.autoscaling.target.averageValue: pattern"),
    ("prometheus for hpa", {"autoscaling": {"maxReplicas": 2, "prometheusAddress": "http://p"}},
     "spec.autoscaling: prometheusAddress applies to engine: keda only"),
    ("ram below -1", {"preempt": {"ramMiB": -2}},
     "spec.preempt.ramMiB: ramMiB must be an integer >= -1 or 'auto'"),
    ("ram word", {"preempt": {"ramMiB": "lots"}},
     "spec.preempt.ramMiB: ramMiB must be an integer >= -1 or 'auto'"),
    ("pool smaller than the slots", {"parallel": 64, "pageSize": 16, "contextSize": 512},
     "spec: contextSize must hold at least one page per slot (parallel * pageSize)"),
    ("bad memory", {"resources": {"memory": "lots"}}, "spec.resources.memory: pattern"),
    ("bad pull policy", {"imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy: enum"),
    ("secret without name", {"server": {"apiKeySecretRef": {"key": "k"}}},
     "spec.server.apiKeySecretRef: required"),
    ("env without name", {"server": {"env": [{"value": "1"}]}}, "spec.server.env.0: required"),
    ("args not strings", {"server": {"args": [1]}}, "spec.server.args.0: type"),
]


@pytest.mark.parametrize("spec, reason", [(s, r) for _, s, r in BAD],
                         ids=[name for name, _, _ in BAD])
def test_bad_resources_fail_for_their_reason(spec: dict, reason: str) -> None:
    obj = resource(spec)
    assert all_errors(obj) == {reason}


def test_each_bad_resource_is_one_change_from_a_good_one() -> None:
    """The table's resources are invalid because of what they name, not by accident."""
    fixes = {"zero slots": {"parallel": 1}, "hf without revision": {"model": {
        "uri": "hf://org/repo", "revision": "v1"}}, "min above max": {"autoscaling": {
            "minReplicas": 2, "maxReplicas": 2}}, "ram below -1": {"preempt": {"ramMiB": -1}},
        "no rollout can move": {"strategy": {"maxSurge": 0, "maxUnavailable": "10%"}},
        "surge word": {"strategy": {"maxSurge": "25%"}}}
    for name, spec, _ in BAD:
        if name in fixes:
            fixed = copy.deepcopy(spec) | fixes[name]
            assert all_errors(resource(fixed)) == set(), name
