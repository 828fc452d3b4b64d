"""Routing and dashboards: the InferencePool for a Gateway's endpoint picker, the metric names the
picker and the Grafana dashboard read, checked against what pod/metrics/prometheus.py exports.

InferencePool belongs to CRDs that kubernetes-validate's official schemas lack: its fields are
checked against a transcription of the upstream CRDs' required fields (v1alpha2 from
config/crd/bases/inference.networking.x-k8s.io_inferencepools.yaml; v1 from the API reference),
not against the CRDs themselves. The kmock RBAC scenario (test_operator_rbac.py) creates,
changes and deletes a pool in each group."""

from __future__ import annotations

import ast
import json
import re
import subprocess

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml
from kmock_harness import REPO
from test_operator_builders import build
from test_operator_crd import all_errors, resource

from kvpark.operator import autoscaling, builders
from kvpark.pod.args import parse_args
from kvpark.pod.serving.kv_event_publisher import parse_config

V1, ALPHA = builders.INFERENCE_POOLS
ROUTING = {"inferencePool": {"endpointPicker": {"name": "epp"}}}
SELECTOR = {"app.kubernetes.io/name": "kvpark-server", "app.kubernetes.io/instance": "llm"}
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
FAILURE = {"enum": ["FailOpen", "FailClose"]}
POOL_SPECS = {
    "inference.networking.k8s.io/v1": {
        "type": "object", "additionalProperties": False,
        "required": ["selector", "targetPorts", "endpointPickerRef"],
        "properties": {
            "selector": {"type": "object", "additionalProperties": False,
                         "required": ["matchLabels"],
                         "properties": {"matchLabels": {"type": "object"}}},
            "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
                "type": "object", "additionalProperties": False, "required": ["number"],
                "properties": {"number": PORT}}},
            "endpointPickerRef": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"name": NAME, "kind": {"type": "string"}, "group": {},
                               "failureMode": FAILURE, "port": {
                                   "type": "object", "required": ["number"],
                                   "properties": {"number": PORT}}}},
        },
    },
    "inference.networking.x-k8s.io/v1alpha2": {
        "type": "object", "additionalProperties": False,
        "required": ["extensionRef", "selector", "targetPortNumber"],
        "properties": {
            "selector": {"type": "object", "additionalProperties": {"type": "string"}},
            "targetPortNumber": PORT,
            "extensionRef": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"name": NAME, "kind": {"type": "string"}, "group": {},
                               "failureMode": FAILURE, "portNumber": PORT}},
        },
    },
}


def pool_of(spec: dict, served: set[str]) -> tuple[dict | None, object]:
    children = build(spec, served=served)[3]
    pools = [c for c in children.apply if c["kind"] == "InferencePool"]
    return (pools[0] if pools else None), children


@pytest.mark.parametrize("served, api_version", [
    ({V1, ALPHA}, "inference.networking.k8s.io/v1"),
    ({ALPHA}, "inference.networking.x-k8s.io/v1alpha2"),
])
def test_pool_selects_the_servers_pods(served: set[str], api_version: str) -> None:
    pool, children = pool_of({"routing": ROUTING}, served)
    assert pool["apiVersion"] == api_version
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "PreemptServer"
    jsonschema.validate(pool["spec"], POOL_SPECS[api_version])
    spec = pool["spec"]
    if api_version.endswith("/v1"):
        assert spec["selector"] == {"matchLabels": SELECTOR}
        assert spec["targetPorts"] == [{"number": builders.PORT}]
        assert spec["endpointPickerRef"] == {"name": "epp", "kind": "Service",
                                             "port": {"number": 9002},
                                             "failureMode": "FailClose"}
    else:
        assert (spec["selector"], spec["targetPortNumber"]) == (SELECTOR, builders.PORT)
        assert spec["extensionRef"] == {"name": "epp", "kind": "Service", "portNumber": 9002,
                                        "failureMode": "FailClose"}
    assert children.problems == []
    # the Service selects the same pods
    service = next(c for c in children.apply if c["kind"] == "Service")
    assert service["spec"]["selector"] == SELECTOR


def test_no_pool_without_routing_or_without_the_crds() -> None:
    pool, children = pool_of({}, {V1, ALPHA})
    assert pool is None
    assert ("inference.networking.k8s.io/v1", "InferencePool", "llm") in children.delete
    pool, children = pool_of({"routing": ROUTING}, set())
    assert pool is None
    (problem,) = children.problems
    assert (problem.reason, problem.blocking) == ("InferencePoolUnavailable", False)
    assert not any(kind == "InferencePool" for _, kind, _ in children.delete)


def test_routing_schema() -> None:
    assert all_errors(resource({"routing": ROUTING})) == set()
    assert all_errors(resource({"routing": {"inferencePool": {"endpointPicker": {
        "name": "epp", "port": 9003, "failureMode": "FailOpen"}}}})) == set()
    assert all_errors(resource({"routing": {"inferencePool": {}}})) == {
        "spec.routing.inferencePool: required"}
    assert all_errors(resource({"routing": {"inferencePool": {"endpointPicker": {
        "name": "epp", "failureMode": "Maybe"}}}})) == {
        "spec.routing.inferencePool.endpointPicker.failureMode: enum"}


def exported_metrics() -> set[str]:
    """Every series name pod/metrics/prometheus.py exposes, as Prometheus scrapes them."""
    tree = ast.parse((REPO / "pod" / "metrics" / "prometheus.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args
                and isinstance(node.args[0], ast.Constant)):
            continue
        func = node.func.id if isinstance(node.func, ast.Name) else ""
        name = str(node.args[0].value)
        if func == "_gauge":
            names.add(f"kvpark:{name}")
        elif func == "_counter":
            names.add(f"kvpark:{name}_total")
        elif func == "Counter":
            names |= {f"{name}_total", f"{name}_created"}
        elif func == "Histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
    return names


def test_metric_names_are_read_from_the_server() -> None:
    names = exported_metrics()
    assert {"kvpark:requests_deferred", "kvpark:kv_cache_usage_ratio",
            "kvpark:n_preempt_total", "kvpark:preempt_park_seconds_bucket"} <= names
    assert all(s.promql.split("(")[-1].split("{")[0] in names
               for s in autoscaling.SIGNALS.values())


DASHBOARD = REPO / "charts" / "kvpark" / "dashboards" / "kvpark-preemption.json"


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])] + [
        v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]


def test_dashboard_names_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 10
    names = exported_metrics()
    used = {m for e in exprs for m in re.findall(r"kvpark:[a-z_]+", e)}
    assert used - names == set(), "the dashboard asks for series the server does not export"
    # what the issue asks to see
    for wanted in ("kvpark:n_preempt_swap_total", "kvpark:n_preempt_recompute_total",
                   "kvpark:requests_preempted", "kvpark:preempt_ram_bytes",
                   "kvpark:preempt_ram_budget_bytes", "kvpark:kv_cache_usage_ratio",
                   "kvpark:requests_deferred"):
        assert wanted in used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # one server by the PodMonitor's podTargetLabels
    assert all('app_kubernetes_io_instance=~"$instance"' in t["expr"]
               for p in dashboard["panels"] for t in p["targets"])


def test_dashboard_promql_is_balanced() -> None:
    """No PromQL parser here: at least brackets and quotes pair up."""
    for expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        for open_, close in ("()", "{}", "[]"):
            assert expr.count(open_) == expr.count(close), expr
        assert expr.count('"') % 2 == 0, expr


def test_chart_ships_the_dashboard(helm: str) -> None:
    def render(*args: str) -> list[dict]:
        out = subprocess.run([helm, "template", "kvpark", str(REPO / "charts" / "kvpark"),
                              "--namespace", "kvpark-system", *args],
                             check=True, capture_output=True, text=True).stdout
        return [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"]

    assert render() == []
    (config_map,) = render("--set", "dashboards.enabled=true",
                           "--set", "dashboards.namespace=monitoring")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["kvpark-preemption.json"]) == \
        json.loads(DASHBOARD.read_text())
    for version in ("1.29", "1.33"):
        kv.validate(config_map, version, strict=True)


KV_EVENTS = {"inferencePool": {"endpointPicker": {"name": "epp"},
                               "kvEvents": {"modelName": "Qwen/Qwen3.5-4B"}}}


def kv_events_config(container: dict) -> dict:
    """The --kv-events-config the server gets, with the kubelet's $(POD_IP) expanded, read by
    the server's own parser."""
    args = container["args"]
    text = args[args.index("--kv-events-config") + 1].replace("$(POD_IP)", "10.1.2.3")
    assert parse_args(args, env={}).kv_events_config is not None
    return json.loads(text) | {"parsed": parse_config(text)}


@pytest.mark.parametrize("mode, endpoint, port, discover", [
    ("podDiscovery", "tcp://*:5557", True, True),
    ("central", "tcp://epp:5557", False, False),
])
def test_kv_events_for_llm_ds_precise_scorer(mode, endpoint, port, discover) -> None:
    routing = json.loads(json.dumps(KV_EVENTS))
    routing["inferencePool"]["kvEvents"]["mode"] = mode
    _, full, _, children = build({"routing": routing, "pageSize": 32}, served={V1})
    deployment = next(c for c in children.apply if c["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = kv_events_config(container)
    assert config["parsed"].enabled and config["endpoint"] == endpoint
    assert config["topic"] == "kv@10.1.2.3@Qwen/Qwen3.5-4B"  # llm-d's kv@<pod IP>@<model>
    assert any(e["name"] == "POD_IP" for e in container["env"])
    assert ({"name": "kv-events", "containerPort": 5557, "protocol": "TCP"}
            in container["ports"]) is port
    assert deployment["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
    [config_map] = [c for c in children.apply if c["kind"] == "ConfigMap"]
    picker = yaml.safe_load(config_map["data"]["precise-prefix-cache-config.yaml"])
    assert picker["kind"] == "EndpointPickerConfig"
    [scorer] = [p for p in picker["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == 32  # the page size
    assert scorer["parameters"]["kvEventsConfig"]["discoverPods"] is discover
    assert scorer["parameters"]["kvEventsConfig"]["topicFilter"] == "kv@"


def test_without_kv_events_there_is_no_picker_config_and_the_flag_is_the_users() -> None:
    _, _, _, children = build({"routing": ROUTING, "server": {"args": [
        "--kv-events-config", '{"enable_kv_cache_events": true}']}}, served={V1})
    assert not [c for c in children.apply if c["kind"] == "ConfigMap"]
    assert ("v1", "ConfigMap", "llm") in children.delete and not children.problems
    _, _, _, children = build({"routing": KV_EVENTS, "server": {"args": [
        "--kv-events-config", "{}"]}}, served={V1})
    assert [p.reason for p in children.problems] == ["ReservedArgument"]


def test_kv_events_need_a_model_name() -> None:
    spec = {"routing": {"inferencePool": {"endpointPicker": {"name": "epp"}, "kvEvents": {}}}}
    assert all_errors(resource(spec)) == {"spec.routing.inferencePool.kvEvents: required"}
    spec["routing"]["inferencePool"]["kvEvents"] = {"modelName": "m", "mode": "gossip"}
    assert all_errors(resource(spec)) == {"spec.routing.inferencePool.kvEvents.mode: enum"}
