"""Schema defaults as the API server applies and checks them, for any structural schema: a
default filled with the defaults nested in it (`fill_defaults`), the CEL rules a default would
break (`get_default_problems`), and a value given its defaults only inside objects that are
present (`with_defaults`). `crd.py` declares the PreemptServer schema and uses these.

The API server checks every `default` against its own node's schema and CEL rules as written,
without filling the defaults nested in it (k8s.io/apiextensions-apiserver, schema/defaulting/
validation.go): `spec: {default: {}}` under a rule `self.contextSize >= ...` makes the whole CRD
invalid ("no such key: contextSize"). So the CRD carries every object default filled and a rule
that reads a field its node's default lacks without a `has()` is refused here
(tests/operator/crd_check.py then runs the rules on each default).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from typing import Any


def fill_defaults(schema: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with every object `default` filled with the defaults of the fields inside it, as
    the API server would fill them in a resource (the server validates a default unfilled)."""
    node = {}
    for key, value in schema.items():  # in order: the YAML stays as written
        if key == "properties":
            node[key] = {k: fill_defaults(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            node[key] = fill_defaults(value)
        else:
            node[key] = copy.deepcopy(value)
    if isinstance(node.get("default"), Mapping):
        node["default"] = with_defaults(node, node["default"])
    return node


SELF_FIELD = re.compile(r"\bself\.([A-Za-z_][A-Za-z0-9_]*)")


def get_default_problems(schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Rules that would read a field missing from a default: every rule of a node that a default
    holds (the node's own default, or a part of an ancestor's) may read `self.FIELD` only where
    that default has FIELD, or inside `has(self.FIELD)`. The API server refuses the CRD otherwise.
    (A reading check, not a proof: tests/operator/crd_check.py evaluates the rules.)"""
    problems = []
    if "default" in schema:
        problems += [f"{where}: {problem}"
                     for where, problem in _unguarded_reads(schema, schema["default"], path)]
    for key, sub in schema.get("properties", {}).items():
        problems += get_default_problems(sub, f"{path}.{key}".lstrip("."))
    if isinstance(schema.get("items"), Mapping):
        problems += get_default_problems(schema["items"], f"{path}[]")
    return problems


def _unguarded_reads(schema: Mapping[str, Any], value: Any, path: str) -> Iterator[tuple[str, str]]:
    if not isinstance(value, Mapping):
        return
    for rule in schema.get("x-kubernetes-validations", []):
        text = rule["rule"]
        for field in sorted(set(SELF_FIELD.findall(text))):
            if field not in value and f"has(self.{field})" not in text:
                yield path, f"rule {text!r} reads {field}, which the default lacks: give " \
                    f"{field} a default or guard it with has(self.{field})"
    for key, sub in schema.get("properties", {}).items():
        if key in value:
            yield from _unguarded_reads(sub, value[key], f"{path}.{key}".lstrip("."))


def get_checked_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema as the CRD carries it: defaults filled; a rule that would fail on a
    default stops the generator (ValueError), before any API server sees it."""
    filled = fill_defaults(schema)
    problems = get_default_problems(filled)
    if problems:
        raise ValueError("defaults the API server would refuse:\n" + "\n".join(problems))
    return filled


def with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill in `default`s the way the API server does: only inside objects that are present."""
    if not isinstance(value, Mapping) or schema.get("type") != "object":
        return copy.deepcopy(value)
    result = {key: copy.deepcopy(item) for key, item in value.items()}
    for key, prop in schema.get("properties", {}).items():
        if key not in result and "default" in prop:
            result[key] = copy.deepcopy(prop["default"])
        if key in result:
            result[key] = with_defaults(prop, result[key])
    return result
