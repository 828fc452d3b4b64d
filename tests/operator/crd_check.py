"""Offline, what kube-apiserver checks when a CRD is applied and when a custom resource is written.

kmock validates nothing, so without this a CRD the API server refuses passes every test (issue
24: `default: {}` under rules that read the default's fields). Modelled on
k8s.io/apiextensions-apiserver (read, not copied), the parts a CRD like ours can break:

- `check_crd`: the structural-schema rules (a type on every node, int-or-string spelled as the
  server wants it, nothing but value checks inside anyOf/allOf/oneOf/not, no properties beside
  additionalProperties, list-map keys that exist and are required or defaulted), the CEL rules
  (reason, message, compile, fields read that the schema declares, an estimated cost against the
  server's limits), the scale subresource's paths, and every `default` checked against its own
  node's schema and CEL rules as written, *without* filling the defaults nested in it
  (schema/defaulting/validation.go) and pruned (no fields the schema lacks);
- `check_resource`: a custom resource as a create would meet it: unknown fields (kubectl's strict
  field validation), the schema, then the CEL rules on the resource with its defaults applied.

cel-python evaluates the rules. It has no cost estimator, so `estimate_cost` is one after the
API server's model (cel-go's costs, strings and lists as long as a 3 MiB request allows where the
schema sets no maxLength or maxItems) for the CEL this project writes; a rule using anything
else is reported as one it cannot estimate, so that a new construct is looked at, not waved
through. `python tests/operator/crd_check.py FILE` checks a CRD file (`-`: standard input).
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import celpy
import jsonschema
import lark
import yaml

CEL = celpy.Environment()
REASONS = {"FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired",
           "FieldValueDuplicate"}
# k8s.io/apiserver/pkg/apis/cel: the estimated cost one rule may have, and all rules of a CRD
# times how often each can run in one object
PER_RULE_COST_LIMIT = 10_000_000
PER_CRD_COST_LIMIT = 100_000_000
MAX_REQUEST_BYTES = 3 * 1024 * 1024  # bounds what the schema leaves unbounded
JUNCTORS = ("anyOf", "allOf", "oneOf", "not")
# allowed inside a junctor: value validations only
JUNCTOR_FORBIDDEN = ("type", "description", "default", "additionalProperties", "nullable",
                     "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource",
                     "x-kubernetes-int-or-string", "x-kubernetes-validations",
                     "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
                     "x-kubernetes-map-type")
TYPE_NAMES = {"int", "uint", "double", "string", "bool", "bytes", "list", "map", "null_type",
              "type"}


class Finding(NamedTuple):
    path: str  # as the API server names it: spec.validation.openAPIV3Schema.properties[spec]
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.detail}"


def get_schema(crd: Mapping[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def check_crd(crd: Mapping[str, Any]) -> list[Finding]:
    """Everything the API server would refuse in `crd` (a v1 CustomResourceDefinition with one
    version, as ours has)."""
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    root = "spec.validation.openAPIV3Schema"
    findings = list(check_structural(schema, root, is_root=True))
    if findings:
        return findings  # the server stops here too: the rest assumes a structural schema
    findings += check_rules(schema, root)
    findings += check_defaults(schema, root)
    findings += check_scale(version.get("subresources", {}).get("scale"), schema)
    return findings


# ---------------------------------------------------------------- structural schema


def check_structural(schema: Mapping[str, Any], path: str, is_root: bool = False,
                     in_junctor: bool = False) -> Iterator[Finding]:
    if in_junctor:
        for key in JUNCTOR_FORBIDDEN:
            if key in schema:
                yield Finding(f"{path}.{key}", "Forbidden: must not be specified in a "
                              "value validation (anyOf, allOf, oneOf, not)")
    elif schema.get("x-kubernetes-int-or-string"):
        if "type" in schema:
            yield Finding(f"{path}.type", "Forbidden: must be empty with "
                          "x-kubernetes-int-or-string")
        if "anyOf" in schema and schema["anyOf"] != [{"type": "integer"}, {"type": "string"}]:
            yield Finding(f"{path}.anyOf", "Forbidden: x-kubernetes-int-or-string allows only "
                          "anyOf: [{type: integer}, {type: string}]")
    elif not schema.get("type") and not schema.get("x-kubernetes-preserve-unknown-fields"):
        yield Finding(f"{path}.type", "Required value: must not be empty for specified fields")
    if is_root and schema.get("type") != "object":
        yield Finding(f"{path}.type", "Unsupported value: the root must be an object")
    if schema.get("x-kubernetes-preserve-unknown-fields") is False:
        yield Finding(f"{path}.x-kubernetes-preserve-unknown-fields", "Invalid value: must be "
                      "true or undefined")
    extra = schema.get("additionalProperties")
    if "properties" in schema and extra not in (None, False):
        yield Finding(f"{path}.additionalProperties", "Forbidden: additionalProperties and "
                      "properties are mutually exclusive")
    if "pattern" in schema:
        try:
            re.compile(schema["pattern"])
        except re.error as e:
            yield Finding(f"{path}.pattern", f"Invalid value: {e}")
    yield from check_list_map(schema, path)
    if is_root:
        yield from check_root_metadata(schema, path)
    for key, sub in schema.get("properties", {}).items():
        yield from check_structural(sub, f"{path}.properties[{key}]", in_junctor=in_junctor)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from check_structural(schema[key], f"{path}.{key}", in_junctor=in_junctor)
            if key == "additionalProperties" and has_default(schema[key]):
                yield Finding(f"{path}.{key}", "Forbidden: defaults are not allowed under "
                              "additionalProperties")
    for junctor in JUNCTORS:
        subs = schema.get(junctor)
        for i, sub in enumerate(subs if isinstance(subs, list) else [subs] if subs else []):
            if schema.get("x-kubernetes-int-or-string") and junctor == "anyOf":
                continue  # the one allowed spelling, checked above
            yield from check_structural(sub, f"{path}.{junctor}[{i}]", in_junctor=True)


def has_default(schema: Mapping[str, Any]) -> bool:
    """Whether `schema` or a node inside it has a default."""
    inside = [*schema.get("properties", {}).values()]
    if isinstance(schema.get("items"), Mapping):
        inside.append(schema["items"])
    return "default" in schema or any(has_default(s) for s in inside)


def check_list_map(schema: Mapping[str, Any], path: str) -> Iterator[Finding]:
    keys = schema.get("x-kubernetes-list-map-keys")
    if schema.get("x-kubernetes-list-type") != "map":
        if keys:
            yield Finding(f"{path}.x-kubernetes-list-map-keys", "Forbidden: only with "
                          "x-kubernetes-list-type: map")
        return
    items = schema.get("items") or {}
    if schema.get("type") != "array" or items.get("type") != "object" or not keys:
        yield Finding(path, "Invalid value: a list-type map is an array of objects with "
                      "x-kubernetes-list-map-keys")
        return
    for key in keys:
        prop = items.get("properties", {}).get(key)
        if prop is None or prop.get("type") not in ("string", "integer", "boolean", "number"):
            yield Finding(f"{path}.x-kubernetes-list-map-keys", f"Invalid value: {key!r} must "
                          "be a scalar property of the items")
        elif key not in items.get("required", []) and "default" not in prop:
            yield Finding(f"{path}.x-kubernetes-list-map-keys", f"Invalid value: {key!r} must "
                          "be required or have a default")


def check_root_metadata(schema: Mapping[str, Any], path: str) -> Iterator[Finding]:
    meta = schema.get("properties", {}).get("metadata")
    if meta is None:
        return
    if set(meta) - {"type", "properties"} or set(meta.get("properties", {})) - {
            "name", "generateName"}:
        yield Finding(f"{path}.properties[metadata]", "Forbidden: must not specify anything "
                      "other than name and generateName")


# ---------------------------------------------------------------- CEL rules


def iter_nodes(schema: Mapping[str, Any], path: str,
               cardinality: int = 1) -> Iterator[tuple[Mapping[str, Any], str, int]]:
    """(node, path, how many times the node can occur in one object)."""
    yield schema, path, cardinality
    for key, sub in schema.get("properties", {}).items():
        yield from iter_nodes(sub, f"{path}.properties[{key}]", cardinality)
    if isinstance(schema.get("items"), Mapping):
        many = schema.get("maxItems", MAX_REQUEST_BYTES // 2)  # "x," per unbounded item
        yield from iter_nodes(schema["items"], f"{path}.items", cardinality * many)
    if isinstance(schema.get("additionalProperties"), Mapping):
        many = schema.get("maxProperties", MAX_REQUEST_BYTES // 4)  # '"":x,' per entry
        yield from iter_nodes(schema["additionalProperties"], f"{path}.additionalProperties",
                              cardinality * many)


def check_rules(schema: Mapping[str, Any], root: str) -> list[Finding]:
    findings, total = [], 0
    for node, path, cardinality in iter_nodes(schema, root):
        for i, rule in enumerate(node.get("x-kubernetes-validations", [])):
            where = f"{path}.x-kubernetes-validations[{i}]"
            text, message = rule.get("rule", ""), rule.get("message", "")
            if not text.strip():
                findings.append(Finding(f"{where}.rule", "Required value"))
                continue
            if "\n" in message or len(message) > 2048:
                findings.append(Finding(f"{where}.message", "Invalid value: one line, at most "
                                        "2048 characters"))
            if rule.get("reason", "FieldValueInvalid") not in REASONS:
                findings.append(Finding(f"{where}.reason", "Unsupported value: "
                                        f"{rule['reason']!r}"))
            try:
                tree = CEL.compile(text)
            except celpy.CELParseError as e:
                findings.append(Finding(f"{where}.rule", f"Invalid value: compilation failed: "
                                        f"{e}"))
                continue
            try:
                cost = estimate_cost(tree, with_object_meta(node) if path == root else node)
            except TypeCheckError as e:
                findings.append(Finding(f"{where}.rule", f"Invalid value: compilation failed: "
                                        f"{e}"))
                continue
            except CannotEstimate as e:
                findings.append(Finding(f"{where}.rule", f"cannot estimate the cost offline "
                                        f"({e}): extend crd_check.estimate_cost"))
                continue
            if cost > PER_RULE_COST_LIMIT:
                findings.append(Finding(f"{where}.rule", f"Forbidden: estimated rule cost "
                                        f"{cost} exceeds budget {PER_RULE_COST_LIMIT}"))
            total += cost * cardinality
    if total > PER_CRD_COST_LIMIT:
        findings.append(Finding(root, f"Forbidden: x-kubernetes-validations estimated rule cost "
                                f"total {total} exceeds budget {PER_CRD_COST_LIMIT}"))
    return findings


# What a rule at the root sees of `metadata` on kube-apiserver: name and generateName, strings
# (checked there: a rule on self.metadata.name compiles within the cost budget; a fieldPath
# naming it is refused, "must be a valid path")
OBJECT_META = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 253},
    "generateName": {"type": "string", "maxLength": 253}}}


def with_object_meta(schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = {**schema.get("properties", {}), "metadata": OBJECT_META}
    return {**schema, "properties": properties}


class TypeCheckError(Exception):
    """What cel-go's type check refuses: a field the schema does not declare, an unknown name."""


class CannotEstimate(Exception):
    """A CEL construct estimate_cost does not model."""


class Estimate(NamedTuple):
    cost: int
    size: int = 0  # the longest a string or list value can be (0: a scalar)
    schema: Mapping[str, Any] | None = None  # where a value read from self is declared


def max_size(schema: Mapping[str, Any]) -> int:
    """The longest a string or list at `schema` can be; 0 for other values."""
    if schema.get("type") == "array":
        return int(schema.get("maxItems", MAX_REQUEST_BYTES // 2))
    if schema.get("type") == "string" or schema.get("x-kubernetes-int-or-string"):
        if schema.get("format") == "date-time":
            return 64
        return int(schema.get("maxLength", MAX_REQUEST_BYTES - 2))
    return 0


def traversal(size: int) -> int:
    """cel-go's cost of reading a string or list of `size` once (0.1 per element)."""
    return math.ceil(size * 0.1)


def estimate_cost(tree: lark.Tree, schema: Mapping[str, Any]) -> int:
    """The worst-case cost of a rule at `schema`, after cel-go's cost model."""
    return _estimate(tree, schema).cost


def _estimate(node: Any, self_schema: Mapping[str, Any]) -> Estimate:
    if isinstance(node, lark.Token):
        raise CannotEstimate(f"token {node!r}")
    kind, kids = node.data, node.children

    def sub(i: int) -> Estimate:
        return _estimate(kids[i], self_schema)

    if kind in ("expr", "conditionalor", "conditionaland", "relation", "addition",
                "multiplication", "unary", "member", "primary", "paren_expr") and len(kids) == 1:
        return sub(0)
    if kind == "expr":  # c ? a : b
        cond, a, b = sub(0), sub(1), sub(2)
        return Estimate(cond.cost + max(a.cost, b.cost), max(a.size, b.size))
    if kind in ("conditionalor", "conditionaland"):
        return Estimate(sub(0).cost + sub(1).cost)
    if kind in ("relation", "addition", "multiplication"):  # [op(left), right]
        op, a, b = kids[0].data, _estimate(kids[0].children[0], self_schema), sub(1)
        if op == "relation_in":
            return Estimate(a.cost + b.cost + b.size * (1 + traversal(a.size)))
        if op.startswith("relation_"):
            return Estimate(a.cost + b.cost + 1 + traversal(min(a.size, b.size)))
        return Estimate(a.cost + b.cost + 1 + traversal(a.size + b.size), a.size + b.size)
    if kind == "unary":  # [unary_not | unary_neg, operand]
        return Estimate(sub(1).cost)
    if kind == "literal":
        text = str(kids[0])
        return Estimate(0, len(text) - 2 if text[:1] in "'\"" else 0)
    if kind == "ident":
        name = str(kids[0])
        if name == "self":
            return Estimate(1, max_size(self_schema), self_schema)
        if name in TYPE_NAMES:
            return Estimate(0)
        raise TypeCheckError(f"undeclared reference to {name!r}")
    if kind == "member_dot":
        return select(sub(0), str(kids[1]))
    if kind == "member_dot_arg":  # [target, name, arguments]
        if str(kids[1]) not in METHODS:
            raise CannotEstimate(f"method {kids[1]}()")  # macros too: all, exists, map, ...
        return method(sub(0), str(kids[1]), [_estimate(e, self_schema)
                                              for e in argument_list(kids[2:])])
    if kind == "ident_arg":  # [name, arguments]
        name, args = str(kids[0]), argument_list(kids[1:])
        if name not in FUNCTIONS:
            raise CannotEstimate(f"function {name}()")
        if name == "has":
            (arg,) = args
            if presence_of(arg) is None:
                raise TypeCheckError("has() takes a field selection")
            target = _estimate(presence_of(arg), self_schema)
            return Estimate(target.cost)
        values = [_estimate(e, self_schema) for e in args]
        if name in ("type", "int", "uint", "double", "bool", "dyn") and len(values) == 1:
            return Estimate(values[0].cost + 1)
        if name == "string" and len(values) == 1:
            return Estimate(values[0].cost + 1 + traversal(values[0].size),
                            max(values[0].size, 20))
        if name == "size" and len(values) == 1:
            return Estimate(values[0].cost + 1)
        raise CannotEstimate(f"function {name}() with {len(values)} arguments")
    if kind == "list_lit":
        values = [_estimate(e, self_schema) for e in argument_list(kids)]
        return Estimate(10 + sum(v.cost for v in values), len(values))
    raise CannotEstimate(kind)


def argument_list(kids: list[Any]) -> list[Any]:
    if not kids:
        return []
    (exprlist,) = kids
    return list(exprlist.children)


def presence_of(expr: Any) -> Any:
    """The member_dot inside has()'s argument, or None."""
    while isinstance(expr, lark.Tree) and len(expr.children) == 1 and expr.data != "member_dot":
        expr = expr.children[0]
    return expr if isinstance(expr, lark.Tree) and expr.data == "member_dot" else None


def select(target: Estimate, field: str) -> Estimate:
    schema = target.schema
    if schema is None or schema.get("x-kubernetes-preserve-unknown-fields"):
        return Estimate(target.cost + 1)  # dyn: checked at run time
    if field not in schema.get("properties", {}):
        raise TypeCheckError(f"undefined field {field!r}")
    declared = schema["properties"][field]
    return Estimate(target.cost + 1, max_size(declared), declared)


METHODS = {"startsWith", "endsWith", "contains", "matches", "size"}
FUNCTIONS = {"has", "type", "int", "uint", "double", "bool", "dyn", "string", "size"}


def method(target: Estimate, name: str, args: list[Estimate]) -> Estimate:
    argument_cost = sum(a.cost for a in args)
    if name in ("startsWith", "endsWith") and len(args) == 1:
        return Estimate(target.cost + argument_cost + 1 + traversal(args[0].size))
    if name == "contains" and len(args) == 1:
        return Estimate(target.cost + argument_cost + 1
                        + traversal(target.size) * max(1, args[0].size))
    if name == "matches" and len(args) == 1:
        regex = math.ceil(args[0].size * 0.25) or 1
        return Estimate(target.cost + argument_cost + 1
                        + math.ceil((1 + target.size) * 0.1) * regex)
    if name == "size" and not args:
        return Estimate(target.cost + 1)
    raise CannotEstimate(f"method {name}()")


# ---------------------------------------------------------------- defaults


def check_defaults(schema: Mapping[str, Any], path: str) -> Iterator[Finding]:
    """Every default against its own node: pruned, valid by the schema, and passing every CEL
    rule of the node and of the nodes inside it that the default holds, as written."""
    if "default" in schema:
        where, value = f"{path}.default", schema["default"]
        unknown = unknown_fields(schema, value, "")
        if unknown:
            yield Finding(where, f"Invalid value: must not have unknown fields: "
                          f"{', '.join(unknown)}")
        errors = schema_errors(schema, value)
        yield from (Finding(where + (f".{p}" if p else ""), f"Invalid value: {e}")
                    for p, e in errors)
        if not errors:
            yield from cel_findings(schema, value, where, server_style=True)
    for key, sub in schema.get("properties", {}).items():
        yield from check_defaults(sub, f"{path}.properties[{key}]")
    if isinstance(schema.get("items"), Mapping):
        yield from check_defaults(schema["items"], f"{path}.items")


def schema_errors(schema: Mapping[str, Any], value: Any) -> list[tuple[str, str]]:
    """(dotted path, JSON-schema keyword) for each way `value` breaks `schema`."""
    validator = jsonschema.Draft202012Validator(without_extensions(schema))
    return sorted({(".".join(str(p) for p in e.absolute_path), e.validator)
                   for e in validator.iter_errors(value)})


def without_extensions(schema: Any) -> Any:
    """The schema without its nodes' defaults: a default is no constraint, and the defaults
    inside a default's node must not fill it (jsonschema would not, but say so)."""
    if isinstance(schema, Mapping):
        return {k: without_extensions(v) for k, v in schema.items() if k != "default"}
    if isinstance(schema, list):
        return [without_extensions(v) for v in schema]
    return schema


def unknown_fields(schema: Mapping[str, Any], value: Any, path: str) -> list[str]:
    """Fields of `value` the schema does not declare (pruned by the server, refused by strict
    field validation)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(value, dict):
        if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
            return [u for i, item in enumerate(value)
                    for u in unknown_fields(schema["items"], item, f"{path}[{i}]")]
        return []
    found = []
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        where = f"{path}.{key}".lstrip(".")
        if path == "" and key == "metadata":
            continue  # ObjectMeta: the server's own type, not the schema's
        if key in schema.get("properties", {}):
            found += unknown_fields(schema["properties"][key], item, where)
        elif isinstance(extra, Mapping):
            found += unknown_fields(extra, item, where)
        elif extra is not True and schema.get("type") == "object" and not (
                path == "" and key in ("apiVersion", "kind")):
            found.append(where)
    return found


def cel_findings(schema: Mapping[str, Any], value: Any, path: str,
                 server_style: bool = False) -> Iterator[Finding]:
    """Run the rules of `schema` and of every node that `value` holds. A rule that cannot be
    evaluated (it reads a field the value lacks) is a finding, as on the server."""
    for rule in schema.get("x-kubernetes-validations", []):
        program = CEL.program(CEL.compile(rule["rule"]))
        message = rule.get("message") or f"failed rule: {rule['rule']}"
        try:
            result = program.evaluate({"self": celpy.json_to_cel(value)})
        except celpy.CELEvalError as e:  # raised where the whole rule is an error
            result = e
        if isinstance(result, celpy.CELEvalError):
            yield Finding(path, f'Invalid value: "object": {get_cause(result)} evaluating '
                          f"rule: {message}")
        elif not isinstance(result, celpy.celtypes.BoolType):
            yield Finding(path, f"Invalid value: rule {rule['rule']!r} gave {result!r}")
        elif not result:  # reported on the rule's fieldPath where it names one
            where = f"{path}{rule['fieldPath']}" if rule.get("fieldPath") else path
            yield Finding(where or "<nil>",  # the server's word for the object's root
                          f'Invalid value: "object": {message}' if server_style else message)
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key, extra)
            if isinstance(sub, Mapping) and item is not None:
                yield from cel_findings(sub, item, f"{path}.{key}" if path else key,
                                        server_style)
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from cel_findings(schema["items"], item, f"{path}[{i}]", server_style)


def get_cause(error: celpy.CELEvalError) -> str:
    """cel-python's error as cel-go words it where they mean the same: 'no such key: FIELD'."""
    text = " ".join(str(a) for a in error.args)
    missing = re.search(r"no such member in mapping: \\?'(\w+)", text)
    return f"no such key: {missing.group(1)}" if missing else text


# ---------------------------------------------------------------- the scale subresource


def check_scale(scale: Mapping[str, Any] | None, schema: Mapping[str, Any]) -> Iterator[Finding]:
    if not scale:
        return
    wanted = {"specReplicasPath": (".spec.", "integer"),
              "statusReplicasPath": (".status.", "integer"),
              "labelSelectorPath": ("", "string")}
    for key, (prefix, type_) in wanted.items():
        path = scale.get(key)
        if path is None:
            continue
        where = f"spec.subresources.scale.{key}"
        if not path.startswith(prefix or ".") or (
                key == "labelSelectorPath" and not path.startswith((".spec.", ".status."))):
            yield Finding(where, f"Invalid value: {path!r} must be a JSON path under "
                          f"{prefix or '.spec or .status'}")
            continue
        node = schema
        for part in path.strip(".").split("."):
            node = node.get("properties", {}).get(part, {})
        if node.get("type") != type_:
            yield Finding(where, f"Invalid value: {path!r} must be a {type_} in the schema")


# ---------------------------------------------------------------- custom resources


def with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """`default`s applied the way the API server applies them: inside objects present only, a
    default placed and then defaulted itself."""
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [with_defaults(schema["items"], v) for v in value]
    if not isinstance(value, dict):
        return copy.deepcopy(value)
    result = copy.deepcopy(value)
    for key, prop in schema.get("properties", {}).items():
        if key not in result and "default" in prop:
            result[key] = copy.deepcopy(prop["default"])
        if key in result:
            result[key] = with_defaults(prop, result[key])
    return result


def check_resource(crd: Mapping[str, Any], obj: Mapping[str, Any]) -> list[str]:
    """What creating `obj` would meet: unknown fields (`unknown: PATH`), schema errors
    (`PATH: KEYWORD`), then the CEL rules on the defaulted object (`PATH: MESSAGE`)."""
    schema = get_schema(crd)
    unknown = [f"unknown: {p}" for p in unknown_fields(schema, obj, "")]
    structural = [f"{p}: {e}" for p, e in schema_errors(schema, obj)]
    if unknown or structural:
        return unknown + structural  # the server stops at these too
    return [str(f) for f in cel_findings(schema, with_defaults(schema, obj), "")]


def main(argv: list[str]) -> int:
    text = sys.stdin.read() if argv[1:] in ([], ["-"]) else open(argv[1]).read()
    crds = [d for d in yaml.safe_load_all(text) if d and d.get("kind") ==
            "CustomResourceDefinition"]
    findings = [f"{c['metadata']['name']}: {f}" for c in crds for f in check_crd(c)]
    print("\n".join(findings) or f"{len(crds)} CRD(s): nothing the API server would refuse")
    return 1 if findings or not crds else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
