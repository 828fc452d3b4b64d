"""Pure: `routing.inferencePool.kvEvents` -> what llm-d's precise prefix-cache scorer needs of
the pods, and a starting config for the endpoint picker.

The servers publish vLLM's KV events (`--kv-events-config`) with llm-d's topic,
`kv@<pod IP>@<model>` (the pod IP from the downward API, expanded by the kubelet in the
container's args), in one of llm-d's two layouts:
- `podDiscovery` (default): each pod binds `tcp://*:<port>` (a `kv-events` container port) and
  the picker subscribes to every pod of the pool;
- `central`: each pod connects to the endpoint picker's Service at `<port>`, where the picker
  binds one socket for all.
The pods carry `llm-d.ai/engine-type: vllm` (whenever an InferencePool is made), so the picker
reads kvpark's `vllm:` metric names without flags. The ConfigMap (named like the PreemptServer,
key `precise-prefix-cache-config.yaml`) is an EndpointPickerConfig to mount into the picker:
the precise scorer with the pods' page size as its block size, the event socket and topic
filter of the chosen layout, next to the utilisation and queue scorers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml

from kvpark.operator.metadata import get_metadata

ENGINE_LABEL = "llm-d.ai/engine-type"
ENGINE = "vllm"  # kvpark serves vLLM's metric and event names
TOPIC_PREFIX = "kv@"
CONFIG_KEY = "precise-prefix-cache-config.yaml"
PORT_NAME = "kv-events"
POD_IP_ENV = "POD_IP"


def get_settings(spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return spec.get("routing", {}).get("inferencePool", {}).get("kvEvents")


def get_endpoint(spec: Mapping[str, Any]) -> str:
    settings = get_settings(spec)
    assert settings is not None
    if settings["mode"] == "central":  # the picker's Service, in the same namespace
        picker = spec["routing"]["inferencePool"]["endpointPicker"]["name"]
        return f"tcp://{picker}:{settings['port']}"
    return f"tcp://*:{settings['port']}"


def get_server_args(spec: Mapping[str, Any]) -> list[str]:
    settings = get_settings(spec)
    if settings is None:
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": get_endpoint(spec),
              "topic": f"{TOPIC_PREFIX}$({POD_IP_ENV})@{settings['modelName']}"}
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def get_env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    if get_settings(spec) is None:
        return []
    return [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def get_ports(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    settings = get_settings(spec)
    if settings is None or settings["mode"] != "podDiscovery":
        return []
    return [{"name": PORT_NAME, "containerPort": settings["port"], "protocol": "TCP"}]


def get_pod_labels(spec: Mapping[str, Any]) -> dict[str, str]:
    return {ENGINE_LABEL: ENGINE} if "inferencePool" in spec.get("routing", {}) else {}


def get_picker_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """An EndpointPickerConfig for llm-d's inference scheduler."""
    settings = get_settings(spec)
    assert settings is not None
    discover = settings["mode"] == "podDiscovery"
    events: dict[str, Any] = {"topicFilter": TOPIC_PREFIX, "discoverPods": discover,
                              "concurrency": 4}
    if discover:
        events["podDiscoveryConfig"] = {"socketPort": settings["port"]}
    else:
        events["zmqEndpoint"] = f"tcp://*:{settings['port']}"
    scorer = {"tokenProcessorConfig": {"blockSize": spec["pageSize"]},
              "indexerConfig": {"tokenizersPoolConfig": {"modelName": settings["modelName"]}},
              "kvEventsConfig": events}
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "single-profile-handler"},
                    {"type": "precise-prefix-cache-scorer", "parameters": scorer},
                    {"type": "kv-cache-utilization-scorer"}, {"type": "queue-scorer"},
                    {"type": "max-score-picker"}],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "precise-prefix-cache-scorer", "weight": 3.0},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 2.0},
            {"pluginRef": "queue-scorer", "weight": 2.0},
            {"pluginRef": "max-score-picker"}]}],
    }


def get_config_map(body: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": get_metadata(body),
            "data": {CONFIG_KEY: yaml.safe_dump(get_picker_config(spec), sort_keys=False)}}
