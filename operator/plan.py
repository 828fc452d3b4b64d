"""Pure: the children a PreemptServer should have and what exists now -> the writes to make.

The operator writes only objects it owns: those carrying its controller owner reference (the
PreemptServer's uid). An object of a child's name that it does not own is left alone: when the
operator wants that child it is a NameConflict (reported, nothing touched); when it wants the
child gone, the object is simply not its to delete.

Deletes go first: KEDA's admission webhook refuses a ScaledObject while an HPA scales the same
target, so switching `autoscaling.engine` removes the old autoscaler before making the new one.

A child is applied only when it is missing or differs from what the operator wants: its
`kvpark.io/spec-hash` annotation (the hash of what was last applied) changed, or a field the
operator sets was changed by someone else. A steady state makes no writes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from kubernetes.utils.quantity import parse_quantity

from kvpark.operator import crd
from kvpark.operator.status import Problem

HASH_ANNOTATION = f"{crd.GROUP}/spec-hash"
Key = tuple[str, str]  # (kind, name): a PreemptServer may have two children of a kind (PVCs)


class Write(NamedTuple):
    verb: str  # "apply" or "delete"
    kind: str
    name: str
    obj: dict[str, Any] | None = None  # apply: the object, with its hash annotation
    uid: str = ""  # delete: the uid it was decided for (a precondition of the DELETE)
    api_version: str = ""  # delete: the group/version it lives at


class Plan(NamedTuple):
    writes: list[Write]  # in order: deletes, then applies
    problems: list[Problem]


def is_owned(obj: Mapping[str, Any], owner_uid: str) -> bool:
    """Whether `obj` carries the PreemptServer's controller owner reference."""
    owners = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(o.get("controller") and o.get("uid") == owner_uid and o.get("kind") == crd.KIND
               for o in owners)


def get_hash(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = dict(obj["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), HASH_ANNOTATION: get_hash(obj)}
    return {**obj, "metadata": meta}


def is_subset(want: Any, have: Any) -> bool:
    """Every field of `want` is in `have` with the same value, as the API server stores it: it
    adds defaults, drops empty maps and lists, and writes quantities its own way (2Gi for
    2048Mi, 800m for 0.8)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            is_subset(v, have[k]) if k in have else v in ({}, [], None)
            for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(
            is_subset(w, h) for w, h in zip(want, have))
    return want == have or is_same_quantity(want, have)


def is_same_quantity(want: Any, have: Any) -> bool:
    if not (isinstance(want, (str, int)) and isinstance(have, (str, int))) \
            or isinstance(want, bool) or isinstance(have, bool):
        return False
    try:
        return bool(parse_quantity(want) == parse_quantity(have))
    except (ValueError, TypeError):
        return False


def needs_apply(want: Mapping[str, Any], have: Mapping[str, Any] | None) -> bool:
    if have is None:
        return True
    applied = ((have.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)
    return applied != want["metadata"]["annotations"][HASH_ANNOTATION] or not is_subset(want, have)


def get_conflict(kind: str, have: Mapping[str, Any]) -> Problem:
    meta = have.get("metadata") or {}
    owners = [f"{o.get('kind')} {o.get('name')}" for o in meta.get("ownerReferences") or []
              if o.get("controller")]
    held = f"owned by {owners[0]}" if owners else "not owned by this PreemptServer"
    return Problem("NameConflict", f"{kind} {meta.get('name')} already exists, {held}: left "
                   "alone (delete or rename it, or rename the PreemptServer)", blocking=False)


def get_key(obj: Mapping[str, Any]) -> Key:
    return obj["kind"], obj["metadata"]["name"]


def get_plan(apply: list[dict[str, Any]], delete: list[tuple[str, str, str]],
             existing: Mapping[Key, Mapping[str, Any] | None], owner_uid: str) -> Plan:
    """`apply`: wanted children; `delete`: (apiVersion, kind, name) not wanted; `existing`: what
    a GET found by (kind, name) (None: absent). Children missing from `existing` could not be
    read and are left for the next reconcile."""
    deletes, applies, problems = [], [], []
    for api_version, kind, name in delete:
        have = existing.get((kind, name))
        if have is not None and is_owned(have, owner_uid):
            deletes.append(Write("delete", kind, name, uid=have["metadata"]["uid"],
                                 api_version=api_version))
    for obj in apply:
        kind, name = key = get_key(obj)
        if key not in existing:
            continue
        have = existing[key]
        if have is not None and not is_owned(have, owner_uid):
            problems.append(get_conflict(kind, have))
            continue
        want = with_hash(obj)
        if needs_apply(want, have):
            applies.append(Write("apply", kind, name, obj=want))
    return Plan(deletes + applies, problems)
