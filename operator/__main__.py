"""`python -m kvpark.operator` runs the operator (kopf run); `... crd` prints the CRD YAML and
`... podspec-schema` the PodSpec schema that spec.podTemplate is checked against (podschema.py)."""

from __future__ import annotations

import secrets
import sys

from kvpark.operator import crd, peering, podschema
from kvpark.operator.config import OperatorConfig


def get_kopf_args(config: OperatorConfig, priority: int = 0) -> list[str]:
    """`kopf run` arguments: peering under `priority` (the highest live replica works, see
    peering.py), or one replica standalone; watched namespaces or all."""
    args = ["run", "-m", "kvpark.operator.handlers"]
    if config.peering:
        args += [f"--peering={config.peering}", f"--priority={priority}"]
    else:
        args += ["--standalone"]
    args += [f"--namespace={n}" for n in config.namespaces] or ["--all-namespaces"]
    if config.liveness:
        args.append(f"--liveness={config.liveness}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["crd"]:
        sys.stdout.write(crd.crd_yaml())
        return 0
    if argv[:1] == ["podspec-schema"]:  # a developer's command: needs kubernetes-validate
        sys.stdout.write(podschema.schema_yaml())
        return 0
    from kopf import cli  # imported here: `crd` works without kopf installed

    priority = 1 + secrets.randbelow(peering.MAX_PRIORITY)  # a new draw at every start
    cli.main(args=get_kopf_args(OperatorConfig.from_env(), priority) + argv,
             prog_name="kvpark-operator")
    return 0


if __name__ == "__main__":
    sys.exit(main())
