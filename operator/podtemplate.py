"""Pure: `spec.podTemplate`, a strategic-merge-style patch over the pod template the operator
builds (affinity, topology spread, priority and runtime classes, annotations, extra volumes,
sidecars, extra env and mounts on the server container).

The merge, as `kubectl patch --type strategic` does it for these fields:
- maps merge key by key; a null value removes the key;
- lists of named items merge item by item on their key (MERGE_KEYS: containers by name, env by
  name, volumes by name, volumeMounts by mountPath, as Kubernetes keys them); an item with
  `$patch: delete` removes the item of that key;
- any other list (tolerations, topologySpreadConstraints, args, ...) is replaced whole.

The patch goes on last, so it wins over what the operator set, except for what the operator owns:
the server container's image, command, args and resources (spec.image, spec.server.args and
spec.resources set them; memory sizing and the reserved-flag check depend on them), its reserved
environment variables, and the selector labels. A patch that touches those is refused
(`OwnedField`, Degraded) and nothing is applied; so is one with a field the core/v1 PodSpec does
not declare or a value of the wrong type (`ChildRejected`, naming the field: podschema.py), which
server-side apply would answer with a 500 that names no field of the PreemptServer.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Set
from typing import Any

from kvpark.operator import podschema
from kvpark.operator.status import Problem

MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "env": "name", "volumes": "name", "volumeMounts": "mountPath",
              "imagePullSecrets": "name"}
DELETE_KEY = "$patch"
DELETE = {DELETE_KEY: "delete"}
OWNED_CONTAINER_FIELDS = ("image", "command", "args", "resources")


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """`base` with `patch` merged in (neither is changed)."""
    if isinstance(patch, Mapping):
        result = copy.deepcopy(dict(base)) if isinstance(base, Mapping) else {}
        for key, value in patch.items():
            if value is None:
                result.pop(key, None)
            else:
                result[key] = merge(result.get(key), value, key)
        return result
    if isinstance(patch, list) and field in MERGE_KEYS:
        return merge_list(base if isinstance(base, list) else [], patch, MERGE_KEYS[field])
    return copy.deepcopy(patch)


def merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    """Items of `base` in their order, each merged with the patch item of the same key; new
    patch items after them, in the patch's order."""
    wanted = {item.get(key): item for item in patch if isinstance(item, Mapping)}
    result = []
    for item in base:
        change = wanted.pop(item.get(key), None) if isinstance(item, Mapping) else None
        if change is None:
            result.append(copy.deepcopy(item))
        elif not is_delete(change):
            result.append(merge(item, without_directive(change)))
    result += [without_directive(item) for item in wanted.values() if not is_delete(item)]
    return result


def is_delete(item: Mapping[str, Any]) -> bool:
    return item.get(DELETE_KEY) == DELETE[DELETE_KEY]


def without_directive(item: Mapping[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in item.items() if k != DELETE_KEY}


def get_template_problems(patch: Mapping[str, Any], selector: Mapping[str, str],
                          container: str, reserved_env: Set[str]) -> list[Problem]:
    """What in `patch` (spec.podTemplate) overrides what the operator owns."""
    owned = []
    labels = (patch.get("metadata") or {}).get("labels") or {}
    owned += [f"metadata.labels.{k}" for k in sorted(labels)
              if k in selector and labels[k] != selector[k]]
    problems = []
    for item in (patch.get("spec") or {}).get("containers") or []:
        if not isinstance(item, Mapping) or item.get("name") != container:
            continue
        where = f"spec.containers[{container}]"
        if is_delete(item):
            owned.append(where)
        owned += [f"{where}.{f}" for f in OWNED_CONTAINER_FIELDS if f in item]
        env = sorted({e.get("name") for e in item.get("env") or []
                      if isinstance(e, Mapping) and e.get("name") in reserved_env})
        if env:
            problems.append(Problem("ReservedArgument", f"podTemplate sets {', '.join(env)} on "
                                    f"the {container} container, which the operator sets from "
                                    "the spec"))
    if owned:
        problems.insert(0, Problem("OwnedField", f"podTemplate sets {', '.join(owned)}, which "
                                   "the operator owns (use spec.image, spec.server.args and "
                                   "spec.resources; the selector labels are fixed)"))
    return problems + get_schema_problems(patch)


def get_schema_problems(patch: Mapping[str, Any]) -> list[Problem]:
    """Fields of the patch's pod spec that the core/v1 PodSpec does not declare, or of another
    type: the API server could not apply the Deployment."""
    errors = podschema.get_errors(patch.get("spec") or {}, "spec.podTemplate.spec",
                                  set(MERGE_KEYS), DELETE_KEY)
    if not errors:
        return []
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return [Problem("ChildRejected", "the Deployment's pod template would be refused: "
                    f"{'; '.join(errors[:3])}{more} (core/v1 PodSpec)")]
