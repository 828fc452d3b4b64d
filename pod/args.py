"""`ServerArgs` from flags and environment.

Every flag `--some-flag` also reads `KVPARK_SOME_FLAG`; the spec's llama.cpp names
`LLAMA_ARG_PREEMPT_RAM`, `LLAMA_ARG_PREEMPT` and `LLAMA_SERVER_PREEMPT_EVERY` are accepted too.
Flags win over the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

ALIASES = {
    "preempt_ram": ("LLAMA_ARG_PREEMPT_RAM",),
    "preempt": ("LLAMA_ARG_PREEMPT",),
    "preempt_every": ("LLAMA_SERVER_PREEMPT_EVERY",),
}
TRUE_WORDS = {"1", "true", "yes", "on", "enabled"}


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
    sse_keepalive: float = 2.0  # seconds between ": keepalive" comments to a parked stream
    api_key: str | None = None
    threads: int = 0  # 0: pick from the machine
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    max_messages: int = 4096  # chat messages per request
    max_prompt_chars: int = 0  # 0: what the context could ever hold (protocol.CHARS_PER_TOKEN)
    shutdown_timeout: float = 30.0
    attention_backend: str = "auto"
    dtype: str = "auto"
    weights: str = "auto"  # CPU linears: auto / gguf (decode from the GGUF's blocks), fp32, bf16
    device: str = "auto"
    batch_invariant: bool = True
    cuda_graph: bool = True
    gpu_memory_fraction: float = 0.9
    log_level: str = "info"

    def __repr__(self) -> str:  # the API key never reaches a log
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if shown["api_key"]:
            shown["api_key"] = "***"
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
    number = float(value)
    if not 0 < number <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage in (0, 100], got {value}")
    return number


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpark-server", description=__doc__.splitlines()[0])
    p.add_argument("--model", "-m", help="GGUF file, Hugging Face directory, "
                   "builtin://smollm2-135m (default) or synthetic:NAME")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
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
    p.add_argument("--preempt-every", type=int, help=argparse.SUPPRESS)
    p.add_argument("--preempt-high", type=_percent,
                   help="park proactively when the next step would pass PCT of the pool (94)")
    p.add_argument("--preempt-low", type=_percent,
                   help="restore parked sequences only while the pool stays below PCT (80)")
    p.add_argument("--preempt-resume", choices=["fair", "spec"],
                   help="restore order: spec = most-preempted first, then longest parked, "
                   "fit-first (default: the lower worst-case wait measured); fair = "
                   "head-of-line by park time")
    p.add_argument("--sse-keepalive", type=float,
                   help="seconds between ': keepalive' comments to a parked stream (2)")
    p.add_argument("--api-key")
    p.add_argument("--threads", "-t", type=int, help="torch threads (0: auto)")
    p.add_argument("--max-queue", type=_positive, help="queued requests before 503")
    p.add_argument("--max-body-bytes", type=_positive, help="largest request body (413 above)")
    p.add_argument("--max-messages", type=_positive,
                   help="chat messages per request (4096; 400 above)")
    p.add_argument("--max-prompt-chars", type=_non_negative,
                   help="prompt characters per request, 400 above (0: 32 per token of context)")
    p.add_argument("--shutdown-timeout", type=float, help="seconds to drain on SIGTERM")
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
    p.add_argument("--gpu-memory-fraction", type=float,
                   help="share of free GPU memory the KV pool may take when -c is not given")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def _from_env(name: str, env: Mapping[str, str]) -> str | None:
    for key in (f"KVPARK_{name.upper()}", *ALIASES.get(name, ())):
        # a Service named "kvpark" makes Kubernetes inject KVPARK_PORT=tcp://...: not ours
        if key in env and not env[key].startswith(("tcp://", "udp://")):
            return env[key]
    return None


def _coerce(field_type: str, raw: str) -> object:
    if "bool" in field_type:
        return raw.strip().lower() in TRUE_WORDS
    if field_type.startswith("int"):
        return int(raw)
    if field_type.startswith("float"):
        return float(raw)
    return raw


def parse_args(argv: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None) -> ServerArgs:
    env = os.environ if env is None else env
    parsed = vars(build_parser().parse_args(argv))
    values: dict[str, object] = {}
    for f in fields(ServerArgs):
        if parsed.get(f.name) is not None:
            values[f.name] = parsed[f.name]
            continue
        raw = _from_env(f.name, env)
        if raw is not None:
            values[f.name] = _coerce(str(f.type), raw)
    if "preempt_ram" in values:
        values["preempt_ram"] = _preempt_ram(str(values["preempt_ram"]))
    args = ServerArgs(**values)
    if args.preempt_low > args.preempt_high:
        raise SystemExit(f"--preempt-low {args.preempt_low} must not exceed --preempt-high "
                         f"{args.preempt_high}")
    if args.weights not in ("auto", "gguf", "fp32", "bf16"):
        raise SystemExit(f"KVPARK_WEIGHTS must be auto, gguf, fp32 or bf16, not {args.weights}")
    if args.max_messages <= 0 or args.max_prompt_chars < 0:
        raise SystemExit("KVPARK_MAX_MESSAGES must be positive, KVPARK_MAX_PROMPT_CHARS >= 0")
    if args.preempt_resume not in ("fair", "spec"):
        raise SystemExit(f"KVPARK_PREEMPT_RESUME must be fair or spec, not {args.preempt_resume}")
    return args
