"""`ServerArgs` from flags and environment.

Every flag `--some-flag` also reads `KVPARK_SOME_FLAG`; the spec's llama.cpp names
`LLAMA_ARG_PREEMPT_RAM`, `LLAMA_ARG_PREEMPT` and `LLAMA_SERVER_PREEMPT_EVERY` are accepted too.
Flags win over the environment. An environment value goes through the flag's own parser and
checks (it becomes the flag's default), so a bad one is the same one-line error, exit code 2.
An empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import NoReturn

ALIASES = {
    "preempt_ram": ("LLAMA_ARG_PREEMPT_RAM",),
    "preempt": ("LLAMA_ARG_PREEMPT",),
    "preempt_every": ("LLAMA_SERVER_PREEMPT_EVERY",),
}
TRUE_WORDS = {"1", "true", "yes", "on", "enabled"}
FALSE_WORDS = {"0", "false", "no", "off", "disabled"}


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 4
    ctx_size: int | None = None  # None: 8192 on the CPU, sized from free memory on CUDA
    page_size: int = 16
    batch_size: int = 512
    preempt: bool = True
    preempt_ram: str = "8192"
    preempt_every: int = 0
    preempt_high: float = 94.0  # % of the pool: park before the next step passes it
    preempt_low: float = 80.0  # % of the pool: restore only below it
    preempt_resume: str = "spec"  # restore order: spec (measured lower worst wait) or fair
    prefix_cache: bool = True  # keep full KV pages across requests, shared by hash
    sse_keepalive: float = 2.0  # seconds between ": keepalive" comments to a parked stream
    api_key: str | None = None
    admin_key: str | None = None  # POST /slots actions; they are off without this or api_key
    threads: int = 0  # 0: pick from the machine
    kernel_threads: int = 0  # C kernels' worker pool; 0: pick from the machine
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    max_messages: int = 4096  # chat messages per request
    max_prompt_chars: int = 0  # 0: what the context could ever hold (protocol.CHARS_PER_TOKEN)
    shutdown_timeout: float = 30.0
    timeout_header: float = 10.0  # seconds to send a request's whole header (then closed)
    timeout_body: float = 30.0  # seconds between two chunks of a request body (then 408)
    max_connections: int = 4096  # open HTTP connections; idle ones are shed first
    attention_backend: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # CPU linears: auto / gguf (decode from the GGUF's blocks), fp32, bf16
    device: str = "auto"
    batch_invariant: bool = True
    cuda_graph: bool = True
    gpu_memory_fraction: float = 0.9
    log_level: str = "info"
    preempt_async: bool = True  # CUDA: swap copies on their own stream (off: synchronous)
    # test only (hidden from --help): faults injected on purpose
    preempt_fail_swap: bool = False  # every host allocation is refused: swaps fall to recompute
    inject_fault_token: int | None = None  # a step holding this prompt token id fails

    def __repr__(self) -> str:  # the keys never reach a log
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        for secret in ("api_key", "admin_key"):
            if shown[secret]:
                shown[secret] = "***"
        return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


def _preempt_ram(value: str) -> str:
    if value == "auto":
        return value
    try:
        mib = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB, -1, 0 or auto, got {value!r}") from None
    if mib < -1:
        raise argparse.ArgumentTypeError(f"--preempt-ram must be >= -1, got {mib}")
    return str(mib)


def _percent(value: str) -> float:
    number = _number(float, value)
    if not 0 < number <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in (0, 100], got {value}")
    return number


def _number(kind: type[int] | type[float], value: str) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}"
                                         f", got {value!r}") from None


def _positive(value: str) -> int:
    number = _number(int, value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = _number(int, value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _port(value: str) -> int:
    number = _number(int, value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {number}")
    return number


def _seconds(value: str) -> float:
    number = _number(float, value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value}")
    return number


def _seconds_or_zero(value: str) -> float:
    number = _number(float, value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value}")
    return number


def _fraction(value: str) -> float:
    number = _number(float, value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvpark-server", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", "-m", help="GGUF file, Hugging Face directory, "
                   "builtin://smollm2-135m (default) or synthetic:NAME")
    p.add_argument("--host")
    p.add_argument("--port", type=_port)
    p.add_argument("--parallel", "-np", type=_positive, help="slots (concurrent sequences)")
    p.add_argument("--ctx-size", "-c", type=_positive,
                   help="KV pool size in tokens, shared by all slots (default: 8192 on the CPU, "
                   "free GPU memory x --gpu-memory-fraction on CUDA)")
    p.add_argument("--page-size", type=_positive, help="tokens per KV page")
    p.add_argument("--batch-size", "-b", type=_positive, help="tokens per step (prefill chunk)")
    p.add_argument("--preempt", action=argparse.BooleanOptionalAction,
                   help="park a slot when the pool is full (default on); --no-preempt fails "
                   "the request with 'Context size has been exceeded.'")
    p.add_argument("--preempt-ram", type=_preempt_ram,
                   help="host MiB for swapped sequences: -1 no limit, 0 always recompute, auto")
    p.add_argument("--preempt-every", type=_non_negative, help=argparse.SUPPRESS)
    p.add_argument("--preempt-high", type=_percent,
                   help="park proactively when the next step would pass PCT of the pool (94)")
    p.add_argument("--preempt-low", type=_percent,
                   help="restore parked sequences only while the pool stays below PCT (80)")
    p.add_argument("--preempt-resume", choices=["fair", "spec"],
                   help="restore order: spec = most-preempted first, then longest parked, "
                   "fit-first (default: the lower worst-case wait measured); fair = "
                   "head-of-line by park time")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction,
                   help="keep full KV pages after a request and share them with any request "
                   "whose prompt starts the same (default on); --no-prefix-cache turns it off")
    p.add_argument("--sse-keepalive", type=_seconds,
                   help="seconds between ': keepalive' comments to a parked stream (2)")
    p.add_argument("--api-key")
    p.add_argument("--admin-key", help="key for POST /slots/{id} (park/unpark); without it the "
                   "--api-key guards them, and with neither they are off (403)")
    p.add_argument("--threads", "-t", type=_non_negative,
                   help="torch threads: prompt GEMMs and the other torch ops (0: auto)")
    p.add_argument("--kernel-threads", type=_non_negative,
                   help="threads of the C kernels (decode rows from GGUF blocks, paged "
                   "attention), a pool that sleeps when idle (0: auto, every core unless the "
                   "start-up measurement finds 1 as fast)")
    p.add_argument("--max-queue", type=_positive, help="queued requests before 503")
    p.add_argument("--max-body-bytes", type=_positive, help="largest request body (413 above)")
    p.add_argument("--max-messages", type=_positive,
                   help="chat messages per request (4096; 400 above)")
    p.add_argument("--max-prompt-chars", type=_non_negative,
                   help="prompt characters per request, 400 above (0: 32 per token of context)")
    p.add_argument("--shutdown-timeout", type=_seconds_or_zero,
                   help="seconds to drain on SIGTERM")
    p.add_argument("--timeout-header", type=_seconds,
                   help="seconds a client has to send a request's whole header; then the "
                   "connection is closed (10)")
    p.add_argument("--timeout-body", type=_seconds,
                   help="seconds to wait for the next chunk of a request body; then 408 (30)")
    p.add_argument("--max-connections", type=_positive,
                   help="open HTTP connections at most (4096, lowered to fit the open-file "
                   "limit); past it the oldest idle one is closed, or the new one gets 503")
    p.add_argument("--attention-backend", choices=["auto", "torch", "cpu", "flashinfer"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--weights", choices=["auto", "gguf", "fp32", "bf16"],
                   help="CPU linears. auto: decode rows read a GGUF's own Q4_1/Q8_0 blocks when "
                        "there are any (gguf insists), prefill rows float32; fp32: float32 for "
                        "all rows; bf16: bf16 weights, activations rounded to bf16 in each GEMM")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   help="results independent of batch composition on the CPU (default on)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction,
                   help="capture decode steps in CUDA graphs (FlashInfer backend; default on)")
    p.add_argument("--gpu-memory-fraction", type=_fraction,
                   help="share of free GPU memory the KV pool may take when -c is not given")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--preempt-async", action=argparse.BooleanOptionalAction,
                   help="CUDA: swap copies on their own stream while others decode (default on)")
    p.add_argument("--preempt-fail-swap", action=argparse.BooleanOptionalAction,
                   help=argparse.SUPPRESS)
    p.add_argument("--inject-fault-token", type=_non_negative, help=argparse.SUPPRESS)
    return p


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not the whole usage: the message names the flag or variable at fault."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _env_keys(name: str) -> tuple[str, ...]:
    return (f"KVPARK_{name.upper()}", *ALIASES.get(name, ()))


def _from_env(name: str, env: Mapping[str, str]) -> tuple[str, str] | None:
    for key in _env_keys(name):
        raw = env.get(key, "")
        # a Service named "kvpark" makes Kubernetes inject KVPARK_PORT=tcp://...: not ours
        if raw and not raw.startswith(("tcp://", "udp://")):
            return key, raw
    return None


def _env_value(action: argparse.Action, key: str, raw: str) -> object:
    """`raw` converted and checked exactly as the flag's own value would be."""
    if isinstance(action, argparse.BooleanOptionalAction):
        word = raw.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(sorted(TRUE_WORDS | FALSE_WORDS))}, got {raw!r}")
        return word in TRUE_WORDS
    value = action.type(raw) if action.type else raw
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(map(str, action.choices))}, got {raw!r}")
    return value


def _apply_env(parser: Parser, env: Mapping[str, str]) -> None:
    names = {f.name for f in fields(ServerArgs)}
    for action in parser._actions:
        found = _from_env(action.dest, env) if action.dest in names else None
        if found is None:
            continue
        key, raw = found
        try:
            action.default = _env_value(action, key, raw)
        except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
            parser.error(f"{key}: {exc}")


def check(args: ServerArgs) -> str | None:
    """What is wrong across flags (each flag's own range is its type's business), or None."""
    if args.preempt_low > args.preempt_high:
        return (f"--preempt-low {args.preempt_low} must not exceed --preempt-high "
                f"{args.preempt_high}")
    return None


def parse_args(argv: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None) -> ServerArgs:
    env = os.environ if env is None else env
    parser = build_parser()
    _apply_env(parser, env)
    parsed = vars(parser.parse_args(argv))
    args = ServerArgs(**{f.name: parsed[f.name] for f in fields(ServerArgs)
                         if parsed.get(f.name) is not None})
    problem = check(args)
    if problem:
        parser.error(problem)
    return args
