"""Pure: the problems in a PreemptServer's spec that only the operator can see (the CRD's schema
cannot say them): server.args that kvpark-server would refuse or that set what the operator
sets from the spec, reserved server.env names, a spec.podTemplate overriding what the operator
owns, more GPUs than the server uses, a kvCache.disk too small for the disk tier.

server.args are read by the server's own flag parser (argparse only: the operator's image has
no torch), so the operator refuses what kvpark-server would: a blocking problem in the status,
with the children left as they were, rather than pods that never start.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from kvpark.operator import crd, kv_cache, podtemplate
from kvpark.operator.status import Problem
from kvpark.pod import args as server_args  # argparse only: the operator needs no torch

# ServerArgs fields the operator sets from the spec: server.args may not set them by any
# spelling, nor server.env by KVPARK_<FIELD> or the llama.cpp aliases.
RESERVED_FIELDS = ("model", "host", "port", "parallel", "ctx_size", "page_size", "preempt",
                   "preempt_ram", "api_key", "shutdown_timeout")
RESERVED_ENV = frozenset(
    ["KVPARK_MEMORY_LIMIT"]
    + [f"KVPARK_{f.upper()}" for f in RESERVED_FIELDS]
    + [alias for f in RESERVED_FIELDS for alias in server_args.ALIASES.get(f, ())]
)
# the flags kvCache.disk sets (reserved only then: without it server.args may run a tier in /tmp)
KV_CACHE_FIELDS = ("cache_disk", "cache_disk_size", "cache_disk_write_out")


class ArgsError(Exception):
    """server.args that kvpark-server would refuse."""


def parse_server_args(args: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """`args` as kvpark-server reads them, but without abbreviations (`--ctx` for `--ctx-size`):
    the parsed values, and the tokens that are no flag of the server."""
    parser = server_args.build_parser()
    parser.allow_abbrev = False  # short flags with their value (-c4096) still parse

    def fail(message: str) -> None:
        raise ArgsError(message)

    parser.error = fail  # type: ignore[method-assign]  # argparse would exit
    return parser.parse_known_args(list(args))


def get_flag(parser: argparse.ArgumentParser, field: str) -> str:
    return next(a.option_strings[0] for a in parser._actions if a.dest == field)


def get_args_problems(args: Sequence[str]) -> list[Problem]:
    try:
        parsed, unknown = parse_server_args(args)
    except ArgsError as e:
        return [Problem("InvalidArgument", f"server.args: {e}")]
    problems = []
    parser = server_args.build_parser()
    reserved = [get_flag(parser, f) for f in RESERVED_FIELDS if getattr(parsed, f) is not None]
    if reserved:
        problems.append(Problem("ReservedArgument", f"server.args sets {', '.join(reserved)}, "
                                "which the operator sets from the spec (use apiKeySecretRef "
                                "for keys)"))
    if unknown:
        problems.append(Problem("UnknownArgument", f"server.args: {' '.join(unknown)}: not "
                                "kvpark-server flags (spell flags in full: abbreviations are "
                                "refused)"))
    return problems


def get_part_flag_problems(args: Sequence[str], fields: Sequence[str],
                           part: str) -> list[Problem]:
    """The flags (ServerArgs `fields`) that the operator sets from the spec's `part` while it is
    given: server.args may not set them too."""
    try:
        parsed, _ = parse_server_args(args)
    except ArgsError:
        return []  # said by get_args_problems
    parser = server_args.build_parser()
    flags = [get_flag(parser, f) for f in fields if getattr(parsed, f) is not None]
    if not flags:
        return []
    return [Problem("ReservedArgument", f"server.args sets {', '.join(flags)}, which the "
                    f"operator sets from {part}")]


def get_kv_events_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """routing.inferencePool.kvEvents sets --kv-events-config."""
    if "kvEvents" not in spec.get("routing", {}).get("inferencePool", {}):
        return []
    return get_part_flag_problems(spec["server"].get("args", []), ("kv_events_config",),
                                  "routing.inferencePool.kvEvents")


def get_kv_cache_problems(spec: Mapping[str, Any]) -> list[Problem]:
    """kvCache.disk sets the disk tier's flags; a size the tier cannot use is refused."""
    if kv_cache.get_settings(spec) is None:
        return []
    return get_part_flag_problems(spec["server"].get("args", []), KV_CACHE_FIELDS,
                                  "kvCache.disk") + kv_cache.get_problems(spec)


def get_namespace_problems(namespace: str, protected: Sequence[str]) -> list[Problem]:
    """The cluster's own namespaces hold its privileged service accounts and controllers: a
    leaked operator token must not be able to start pods there through a PreemptServer."""
    if namespace not in protected:
        return []
    return [Problem("ProtectedNamespace", f"PreemptServers are not served in {namespace}, "
                    "one of the cluster's own namespaces (the operator's "
                    "KVPARK_PROTECTED_NAMESPACES): create it in another namespace")]


def get_spec_problems(spec: Mapping[str, Any], selector: Mapping[str, str],
                      container: str) -> list[Problem]:
    """`selector`, `container`: the pods' selector labels and the server container's name,
    which spec.podTemplate may not change."""
    problems = get_args_problems(spec["server"].get("args", []))
    problems += get_kv_events_problems(spec)
    problems += get_kv_cache_problems(spec)
    problems += podtemplate.get_template_problems(
        spec.get("podTemplate") or {}, selector, container, RESERVED_ENV)
    if spec["resources"]["gpus"] > crd.MAX_GPUS:  # a CRD from before the cap let it through
        problems.append(Problem("TooManyGPUs", f"resources.gpus is {spec['resources']['gpus']} "
                                f"but kvpark-server uses one device: set at most {crd.MAX_GPUS}"))
    env = sorted({e["name"] for e in spec["server"].get("env", []) if e["name"] in RESERVED_ENV})
    if env:
        problems.append(Problem("ReservedArgument", f"server.env sets {', '.join(env)}, which "
                                "the operator sets from the spec"))
    return problems
