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
from dataclasses import dataclass, fields, replace
from typing import NoReturn

from kvpark.kernels.worker_pool import MAX_THREADS as MAX_KERNEL_THREADS

# the KV pool's types by llama-server's names (-ctk/-ctv) and by vLLM's (--kv-cache-dtype)
CACHE_TYPES = {"auto": "auto", "f32": "float32", "bf16": "bfloat16", "f16": "float16"}
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

ALIASES = {
    "preempt_ram": ("LLAMA_ARG_PREEMPT_RAM",),
    "cache_ram": ("LLAMA_ARG_CACHE_RAM",),
    "ctx_checkpoints": ("LLAMA_ARG_CTX_CHECKPOINTS",),
    "preempt": ("LLAMA_ARG_PREEMPT",),
    "preempt_every": ("LLAMA_SERVER_PREEMPT_EVERY",),
    "spec_type": ("LLAMA_ARG_SPEC_TYPE",),
    "cache_type_k": ("LLAMA_ARG_CACHE_TYPE_K",),
    "cache_type_v": ("LLAMA_ARG_CACHE_TYPE_V",),
    "model_draft": ("LLAMA_ARG_MODEL_DRAFT",),
    "spec_draft_n_max": ("LLAMA_ARG_SPEC_DRAFT_N_MAX",),
    "spec_draft_n_min": ("LLAMA_ARG_SPEC_DRAFT_N_MIN",),
    "reasoning_format": ("LLAMA_ARG_THINK",),
    "reasoning": ("LLAMA_ARG_REASONING",),
    "reasoning_budget": ("LLAMA_ARG_THINK_BUDGET",),
    "reasoning_budget_message": ("LLAMA_ARG_THINK_BUDGET_MESSAGE",),
    "chat_template_kwargs": ("LLAMA_ARG_CHAT_TEMPLATE_KWARGS",),
}
# vLLM's --reasoning-parser names whose models write <think> ... </think> blocks
THINK_TAG_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "glm45", "ernie45", "olmo3",
                     "minimax_m2", "kimi_k2", "seed_oss", "hunyuan_a13b")
TRUE_WORDS = {"1", "true", "yes", "on", "enabled"}
FALSE_WORDS = {"0", "false", "no", "off", "disabled"}
MAX_TORCH_THREADS = 512  # llama.cpp's GGML_MAX_N_THREADS


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 4
    ctx_size: int | None = None  # None: 8192 on the CPU, sized from free memory on CUDA
    page_size: int = 16
    batch_size: int = 512
    prefill_first: str = "auto"  # seconds a decode row may sit out steps for waiting prompts
    preempt: bool = True
    preempt_ram: str = "8192"
    preempt_every: int = 0
    preempt_high: float = 94.0  # % of the pool: park before the next step passes it
    preempt_low: float = 80.0  # % of the pool: restore only below it
    preempt_resume: str = "spec"  # restore order: spec (measured lower worst wait) or fair
    prefix_cache: bool = True  # keep full KV pages across requests, shared by hash
    host_cache: bool = True  # evicted prefix-cache pages to host RAM, inside --preempt-ram
    cache_ram: int = -1  # MiB the host cache may hold at most; -1: what parks leave, 0: off
    ctx_checkpoints: int = 2  # a hybrid's state checkpoints per slot in the pool's memory
    sse_keepalive: float = 2.0  # seconds between ": keepalive" comments: parked or queued
    max_stream_backlog: int = 256  # events a stream's client may leave unread, a sequence
    api_key: str | None = None
    admin_key: str | None = None  # POST /slots actions; they are off without this or api_key
    threads: int = 0  # 0: pick from the machine
    kernel_threads: int = 0  # C kernels' worker pool; 0: pick from the machine
    max_queue: int = 256
    max_body_bytes: int = 8 << 20
    max_messages: int = 4096  # chat messages per request
    max_prompt_chars: int = 0  # 0: what the context could ever hold (input_limits.CHARS_PER_TOKEN)
    shutdown_timeout: float = 30.0
    timeout_header: float = 10.0  # seconds to send a request's whole header (then closed)
    timeout_body: float = 30.0  # seconds between two chunks of a request body (then 408)
    max_connections: int = 4096  # open HTTP connections; idle ones are shed first
    attention_backend: str = "auto"
    dtype: str = "auto"
    # the KV pool's type: llama-server's -ctk/-ctv names, or vLLM's --kv-cache-dtype (both)
    cache_type_k: str = "auto"
    cache_type_v: str = "auto"
    kv_cache_dtype: str = "auto"
    weights: str = "auto"  # CPU linears: auto / gguf (decode rows from blocks), fp32, bf16
    amx: str = "auto"  # prompt rows on AMX tiles (bf16 products) where they run: auto, on, off
    device: str = "auto"
    batch_invariant: bool = True
    cuda_graph: bool = True
    gpu_memory_fraction: float = 0.9
    log_level: str = "info"
    served_model_name: tuple[str, ...] = ()  # (): the model file's name
    cors_origin: tuple[str, ...] = ()  # (): no CORS headers
    chat_template: str | None = None  # a jinja file replacing the model's chat template
    # reasoning models (llama-server's names; requests/reasoning_fields.py reads them)
    reasoning_format: str = "auto"  # auto: split think blocks where the template has them
    reasoning: str = "auto"  # on/off: the template's enable_thinking; auto: the template's own
    reasoning_budget: int = -1  # tokens a think block may take; -1: unlimited
    reasoning_budget_message: str = ""  # written before a think block's forced end
    chat_template_kwargs: str | None = None  # a JSON object of template variables
    kv_events_config: str | None = None  # vLLM's JSON: publish KV events for a router
    slot_save_path: str | None = None  # POST /slots/{id}?action=save|restore: files live here
    cache_disk: str | None = None  # the prefix cache's disk tier: page files live here
    cache_disk_size: float = 16.0  # GiB the disk tier's folder may hold
    cache_disk_write_out: float = 10.0  # seconds at shutdown to write what the disk lacks
    preempt_async: bool = True  # CUDA: swap copies on their own stream (off: synchronous)
    # speculative decoding: none, ngram-simple (prompt lookup) or draft-simple (a draft model;
    # the default once --model-draft is given)
    spec_type: str = "none"
    model_draft: str | None = None  # the draft model (same tokenizer, same K/V head shape)
    spec_draft_n_max: int = 3  # draft tokens per step at most (benchmarks/README.md)
    spec_draft_n_min: int = 0  # shorter drafts are not verified
    # sampling defaults for requests that leave a field out (None: not set; see
    # generation_defaults.py): llama-server's flags, vLLM's generation config
    temp: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    n_predict: int | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    generation_config: str = "auto"  # auto: a Hugging Face directory's own; vllm: none; a DIR
    override_generation_config: str | None = None  # a JSON object of sampling fields
    # test only (hidden from --help): faults injected on purpose
    preempt_fail_swap: bool = False  # every host allocation is refused: swaps fall to recompute
    inject_fault_token: int | None = None  # a step holding this prompt token id fails
    inject_fault_late: bool = False  # ... after its forward (a hybrid's state written)

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


def _cache_ram(value: str) -> int:
    mib = _number(int, value)
    if mib < -1:
        raise argparse.ArgumentTypeError(f"--cache-ram must be >= -1, got {mib}")
    return mib


def _gib(value: str) -> float:
    number = _number(float, value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected GiB > 0, got {value}")
    return number


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


def _thread_count(most: int):
    """0 (auto) up to `most`: a count far past the cores cannot help, and OpenMP asked for
    99999 threads hung the start-up"""
    def parse(value: str) -> int:
        number = _non_negative(value)
        if number > most:
            raise argparse.ArgumentTypeError(f"must be 0..{most}, got {number}")
        return number
    return parse


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


def _seconds_or_auto(value: str) -> str:
    if value == "auto":
        return value
    return str(_seconds_or_zero(value))


def _fraction(value: str) -> float:
    number = _number(float, value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value}")
    return number


def _jinja_file(value: str) -> str:
    """A readable jinja file that parses (rendered for each chat later, with the model)."""
    import jinja2  # the only flag that needs it

    try:
        with open(value, encoding="utf-8") as file:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(file.read())
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {value!r}: {exc.strerror}") from None
    except (UnicodeDecodeError, jinja2.TemplateSyntaxError) as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not a jinja template: {exc}") from None
    return value


DESCRIPTION = """\
kvpark-server: an OpenAI- and llama.cpp-compatible LLM server with a paged KV pool whose slots
are parked (swapped to host RAM or dropped and recomputed) when the pool runs full.

Endpoints: /v1/chat/completions, /v1/completions, /v1/models (also without /v1), /completion,
/tokenize, /detokenize, /props, /slots, /health, /metrics, /openapi.json.
"""
EPILOG = """\
Every flag also reads KVPARK_<FLAG> from the environment (e.g. KVPARK_CTX_SIZE=4096); flags win.
A request's `model` field that names no served model is accepted and answered by this model,
as llama-server does (--served-model-name sets what /v1/models lists and responses echo).
"""
DEFAULTS = ServerArgs()


def _help(dest: str, text: str, default: object = None) -> str:
    """llama-server's style: what it does, its default, the environment variable."""
    shown = getattr(DEFAULTS, dest) if default is None else default
    if isinstance(shown, bool):
        shown = "enabled" if shown else "disabled"
    env = ", ".join(_env_keys(dest))
    return f"{text} (default: {shown}; env: {env})"


def _add(group: argparse._ArgumentGroup, *flags: str, dest: str, text: str,
         default: object = None, **kw: object) -> None:
    group.add_argument(*flags, dest=dest, help=_help(dest, text, default), **kw)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvpark-server", description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(p.add_argument_group("server"))
    add_model_flags(p.add_argument_group("model"))
    add_sampling_flags(p.add_argument_group("sampling defaults (a request's own fields win)"))
    add_pool_flags(p.add_argument_group("slots and KV pool"))
    add_kv_event_flags(p.add_argument_group("KV events (vLLM's, for a router)"))
    add_preemption_flags(p.add_argument_group("preemption (parking slots when the pool is full)"))
    add_speculation_flags(p.add_argument_group("speculative decoding (llama-server's names)"))
    add_limit_flags(p.add_argument_group("limits and timeouts"))
    hidden = p.add_argument_group("test only")  # faults injected on purpose; not in --help
    hidden.add_argument("--preempt-every", type=_non_negative, help=argparse.SUPPRESS)
    hidden.add_argument("--preempt-fail-swap", action=argparse.BooleanOptionalAction,
                        help=argparse.SUPPRESS)
    hidden.add_argument("--inject-fault-token", type=_non_negative, help=argparse.SUPPRESS)
    hidden.add_argument("--inject-fault-late", action=argparse.BooleanOptionalAction,
                        help=argparse.SUPPRESS)
    return p


def add_server_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--host", dest="host", metavar="HOST", text="IP address to listen on")
    _add(g, "--port", dest="port", type=_port, metavar="PORT", text="port to listen on")
    _add(g, "--api-key", dest="api_key", metavar="KEY",
         text="API key clients must send as 'Authorization: Bearer KEY'; /health, /metrics and "
         "/openapi.json stay open", default="none")
    _add(g, "--admin-key", dest="admin_key", metavar="KEY",
         text="key for POST /slots/{id} (park, unpark, save, restore, erase); without it "
         "--api-key guards them, and with neither they are off (403)", default="none")
    _add(g, "--slot-save-path", dest="slot_save_path", metavar="DIR",
         text="directory for POST /slots/{id}?action=save|restore (llama-server's); created "
         "if missing; without it those actions answer 400", default="off")
    _add(g, "--cache-disk", dest="cache_disk", metavar="DIR",
         text="the prefix cache's disk tier: full KV pages as checked files under DIR, read "
         "back on a miss in the pool and host RAM, shared by servers of the same model on the "
         "same machine kind and kept across restarts; created if missing", default="off")
    _add(g, "--cache-disk-size", dest="cache_disk_size", type=_gib, metavar="GIB",
         text="GiB the disk tier may hold; least recently used pages are deleted past it")
    _add(g, "--cache-disk-write-out", dest="cache_disk_write_out", type=_seconds_or_zero,
         metavar="SECONDS", text="at shutdown, after the drain: seconds to write the pages the "
         "disk tier lacks (0 = none)")
    _add(g, "--cors-origin", dest="cors_origin", action=_Names, metavar="ORIGIN",
         text="let browsers on ORIGIN call the API (repeatable or comma-separated; * for any)",
         default="off")
    _add(g, "--threads", "-t", dest="threads", type=_thread_count(MAX_TORCH_THREADS), metavar="N",
         text="torch threads: prompt GEMMs and the other torch ops; 0 = auto: every core where "
              "a start-up measurement finds prompt GEMMs 30%% faster with them and decode rows "
              "run in the C kernels, else half the cores")
    _add(g, "--kernel-threads", dest="kernel_threads", type=_thread_count(MAX_KERNEL_THREADS),
         metavar="N",
         text="threads of the C kernels (decode rows from GGUF blocks, paged attention), a "
         "pool that sleeps when idle; 0 = auto: every core unless the start-up measurement "
         "finds 1 as fast")
    _add(g, "--log-level", dest="log_level", choices=["debug", "info", "warning", "error"],
         text="log verbosity; /health and /metrics polls are access-logged at debug only")


def add_model_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--model", "-m", dest="model", metavar="PATH",
         text="model: a .gguf file, a Hugging Face directory (config.json, *.safetensors, "
         "tokenizer.json), builtin://smollm2-135m or synthetic:NAME; nothing is downloaded",
         default="builtin://smollm2-135m")
    _add(g, "--served-model-name", dest="served_model_name", action=_Names, metavar="NAME",
         text="model name(s) /v1/models lists; responses echo the first (repeatable or "
         "comma-separated). A request naming another model is still served",
         default="the model file's name")
    _add(g, "--chat-template", dest="chat_template", type=_jinja_file, metavar="FILE",
         text="jinja chat template file used instead of the model's own (rendered as "
         "transformers does, with messages, tools, add_generation_prompt)",
         default="the model's")
    add_reasoning_flags(g)
    _add(g, "--device", dest="device", metavar="DEV", text="auto, cpu, cuda or cuda:N")
    _add(g, "--dtype", dest="dtype", choices=["auto", "float32", "bfloat16", "float16"],
         text="compute type; auto = bfloat16 on CUDA, float32 on the CPU")
    _add(g, "--weights", dest="weights", choices=["auto", "gguf", "fp32", "bf16"],
         text="CPU linears. auto: decode rows read blocks where a start-up measurement finds "
         "them faster (a GGUF's own Q4_1/Q8_0, Q8_0 made at load for linears stored without "
         "them, e.g. safetensors), prefill rows float32 (on AMX tiles where they run: --amx); "
         "gguf: blocks, unmeasured; fp32: float32 for all rows; bf16: bf16 weights, "
         "activations rounded to bf16 in each GEMM")
    _add(g, "--amx", dest="amx", choices=["auto", "on", "off"],
         text="with --weights auto/gguf, prefill rows on Intel AMX tiles: bf16 products, "
         "float32 sums and outputs (amx-bf16 linears). auto: where the CPU and OS run AMX; "
         "on: refuse to start without it; off: float32 products (exact, slower)")
    _add(g, "--attention-backend", dest="attention_backend",
         choices=["auto", "torch", "cpu", "flashinfer"],
         text="paged attention kernel; auto = FlashInfer on CUDA, the C kernel on the CPU")
    _add(g, "--batch-invariant", dest="batch_invariant", action=argparse.BooleanOptionalAction,
         text="CPU: a request's output does not depend on what else is in its batch")
    _add(g, "--cuda-graph", dest="cuda_graph", action=argparse.BooleanOptionalAction,
         text="capture decode steps in CUDA graphs (FlashInfer backend)")


def json_object(text: str) -> dict:
    """A flag's JSON object (ValueError says what is wrong): the flags that take JSON read it
    here, and check their keys themselves."""
    import json

    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object")
    return parsed


def _json_object(value: str) -> str:
    try:
        json_object(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _budget(value: str) -> int:
    number = int(_number(int, value))
    if number < -1:
        raise argparse.ArgumentTypeError(f"expected -1 (unlimited) or a token count, got {value}")
    return number


class _ReasoningParser(argparse.Action):
    """vLLM's --reasoning-parser: a think-tag parser is llama-server's deepseek format."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        if values not in THINK_TAG_PARSERS:
            parser.error(f"--reasoning-parser {values}: this server parses <think> blocks: "
                         f"one of {', '.join(THINK_TAG_PARSERS)}")
        namespace.reasoning_format = "deepseek"


def add_reasoning_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--reasoning-format", dest="reasoning_format",
         choices=["auto", "none", "deepseek", "deepseek-legacy"],
         text="a think block's text: deepseek = in message.reasoning_content (and `reasoning`), "
         "none = left in the content, deepseek-legacy = both; auto = deepseek where the chat "
         "template writes <think> blocks")
    _add(g, "--reasoning-parser", dest="reasoning_format", action=_ReasoningParser,
         metavar="NAME", text="vLLM's: a <think>-tag parser name (qwen3, deepseek_r1, ...) "
         "is --reasoning-format deepseek", default="none")
    _add(g, "--reasoning", "-rea", dest="reasoning", choices=["on", "off", "auto"],
         text="thinking on or off through the template's enable_thinking; auto = the "
         "template's own default")
    _add(g, "--reasoning-budget", dest="reasoning_budget", type=_budget, metavar="N",
         text="tokens a think block may take before its end is forced (-1: unlimited, 0: "
         "ends at once)")
    _add(g, "--reasoning-budget-message", dest="reasoning_budget_message", metavar="TEXT",
         text="written before the forced end of a think block", default="none")
    _add(g, "--chat-template-kwargs", "--default-chat-template-kwargs",
         dest="chat_template_kwargs", type=_json_object, metavar="JSON",
         text="variables for the chat template, e.g. '{\"enable_thinking\": false}' (a "
         "request's chat_template_kwargs win)", default="none")


def add_sampling_flags(g: argparse._ArgumentGroup) -> None:
    """llama-server's names and meanings; unset, a request's missing field keeps OpenAI's."""
    def number(value: str) -> float:
        return float(_number(float, value))

    def integer(value: str) -> int:
        return int(_number(int, value))

    for flags, dest, kind, text in (
            (("--temp",), "temp", number, "temperature"),
            (("--top-k",), "top_k", integer, "top-k sampling (0 or -1: off)"),
            (("--top-p",), "top_p", number, "top-p sampling (1.0: off)"),
            (("--min-p",), "min_p", number, "min-p sampling (0.0: off)"),
            (("--seed", "-s"), "seed", integer, "sampling seed (-1: a random one per request)"),
            (("--n-predict", "-n"), "n_predict", integer,
             "tokens to generate at most (-1: until the end or the context is full)"),
            (("--repeat-penalty",), "repeat_penalty", number,
             "penalise repeats of the last --repeat-last-n tokens (1.0: off)"),
            (("--repeat-last-n",), "repeat_last_n", integer,
             "tokens the repeat penalty looks back over (0: off, -1: the whole context)"),
            (("--presence-penalty",), "presence_penalty", number, "presence penalty (0.0: off)"),
            (("--frequency-penalty",), "frequency_penalty", number,
             "frequency penalty (0.0: off)")):
        _add(g, *flags, dest=dest, type=kind, metavar="N", text=text, default="the request's")
    _add(g, "--generation-config", dest="generation_config", metavar="auto|vllm|DIR",
         text="vLLM's: sampling defaults from a generation_config.json; auto = the model "
         "directory's own (a GGUF has none), vllm = none, DIR = that directory's")
    _add(g, "--override-generation-config", dest="override_generation_config", metavar="JSON",
         text="vLLM's: a JSON object of sampling defaults over the generation config, e.g. "
         "'{\"temperature\": 0.5}'", default="none")


def add_pool_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--parallel", "-np", dest="parallel", type=_positive, metavar="N",
         text="number of slots (sequences decoded at once)")
    _add(g, "--ctx-size", "-c", dest="ctx_size", type=_positive, metavar="N",
         text="KV pool size in tokens, shared by all slots",
         default="8192 on the CPU, free GPU memory x --gpu-memory-fraction on CUDA")
    for flag, short, part in (("--cache-type-k", "-ctk", "K"), ("--cache-type-v", "-ctv", "V")):
        _add(g, flag, short, dest=f"cache_type_{part.lower()}", choices=list(CACHE_TYPES),
             text=f"the KV pool's type for {part} (K and V share one type): f32 or bf16 for a "
             "float32 model on the CPU (bf16: half the memory and half the bytes a decode step "
             "reads; float32 products of the rounded values), else the compute type. auto: bf16 "
             "where prompt rows' attention runs on AMX tiles (--amx; it rounds K and V to bf16 "
             "already), else the compute type (--dtype)")
    _add(g, "--kv-cache-dtype", dest="kv_cache_dtype", choices=list(CACHE_DTYPES),
         text="vLLM's name for --cache-type-k and --cache-type-v together")
    _add(g, "--page-size", dest="page_size", type=_positive, metavar="N",
         text="tokens per KV page")
    _add(g, "--batch-size", "-b", dest="batch_size", type=_positive, metavar="N",
         text="tokens per step at most (prompts are prefilled in chunks of this size)")
    _add(g, "--prefill-first", dest="prefill_first", type=_seconds_or_auto, metavar="SECONDS",
         text="while more prompt tokens wait than one step takes, running sequences' decode "
         "rows sit out steps until one has waited SECONDS since its last one, then all step "
         "together in a decode step (prompts' first tokens sooner, a bounded stall between "
         "tokens); 0 = a decode row joins every step (vLLM's order); auto = 1 on the CPU, 0 on "
         "CUDA")
    _add(g, "--prefix-cache", dest="prefix_cache", action=argparse.BooleanOptionalAction,
         text="keep full KV pages after a request and share them with any request whose "
         "prompt starts the same")
    _add(g, "--gpu-memory-fraction", dest="gpu_memory_fraction", type=_fraction, metavar="F",
         text="share of free GPU memory the KV pool may take when -c is not given")


def add_preemption_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--preempt", dest="preempt", action=argparse.BooleanOptionalAction,
         text="park a slot when the pool is full; --no-preempt fails the request with "
         "'Context size has been exceeded.' instead")
    _add(g, "--preempt-ram", dest="preempt_ram", type=_preempt_ram, metavar="MIB",
         text="host RAM for swapped sequences in MiB: -1 = no limit, 0 = always recompute, "
         "auto = what the machine can spare")
    _add(g, "--host-cache", dest="host_cache", action=argparse.BooleanOptionalAction,
         text="keep pages the prefix cache evicts in host RAM (inside --preempt-ram, parks "
         "first) and copy them back instead of computing them again")
    _add(g, "--ctx-checkpoints", "-ctxcp", "--swa-checkpoints", dest="ctx_checkpoints",
         type=_non_negative, metavar="N",
         text="a hybrid model's (Qwen3.5) state checkpoints kept in the pool's memory per slot, "
         "beside its state slots; more move to host RAM inside --preempt-ram (a cached prefix "
         "is usable up to one)")
    _add(g, "--cache-ram", dest="cache_ram", type=_cache_ram, metavar="MIB",
         text="host RAM the host cache may hold at most, in MiB, inside --preempt-ram: -1 = "
         "what parked sequences leave, 0 = off (as llama-server's --cache-ram)")
    _add(g, "--preempt-high", dest="preempt_high", type=_percent, metavar="PCT",
         text="park proactively when the next step would pass PCT of the pool")
    _add(g, "--preempt-low", dest="preempt_low", type=_percent, metavar="PCT",
         text="restore parked sequences only while the pool stays below PCT")
    _add(g, "--preempt-resume", dest="preempt_resume", choices=["fair", "spec"],
         text="restore order: spec = most-preempted first, then longest parked, fit-first "
         "(the lower worst-case wait measured); fair = head-of-line by park time")
    _add(g, "--preempt-async", dest="preempt_async", action=argparse.BooleanOptionalAction,
         text="CUDA: swap copies run on their own stream while other slots decode")
    _add(g, "--sse-keepalive", dest="sse_keepalive", type=_seconds, metavar="SECONDS",
         text="seconds between ': keepalive' comments to a parked or queued stream")
    _add(g, "--max-stream-backlog", dest="max_stream_backlog", type=_non_negative,
         metavar="N", text="park a stream's sequences while its client leaves more than N "
         "events a sequence unread (a slow or stalled reader), until it has read half of "
         "them; 0: never")


def add_speculation_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--spec-type", dest="spec_type",
         choices=["none", "ngram-simple", "draft-simple", "draft-mtp"],
         text="ngram-simple: draft the tokens that followed the latest earlier occurrence of "
         "the sequence's last 3..1 tokens (prompt lookup, no second model); draft-simple: the "
         "draft model's greedy tokens (--model-draft); draft-mtp: the model's own "
         "multi-token-prediction head (Qwen3.5 checkpoints that carry one). Drafts are "
         "verified in one step; the output is byte-identical to none",
         default="none, or draft-simple with --model-draft")
    _add(g, "--model-draft", "-md", dest="model_draft", metavar="PATH",
         text="draft model for speculative decoding, as --model takes one: the target's "
         "tokenizer and K/V head count and size (checked at start); its K/V live in the same "
         "pages, so parks, the prefix cache and --preempt-ram carry both")
    _add(g, "--spec-draft-n-max", dest="spec_draft_n_max", type=_non_negative, metavar="N",
         text="draft tokens verified per step at most")
    _add(g, "--spec-draft-n-min", dest="spec_draft_n_min", type=_non_negative, metavar="N",
         text="a shorter draft is not verified")


def add_kv_event_flags(g: argparse._ArgumentGroup) -> None:
    # its keys are checked before the model loads (serving/kv_event_publisher.py)
    _add(g, "--kv-events-config", dest="kv_events_config", type=_json_object, metavar="JSON",
         text="vLLM's: publish the prefix cache's KV events for a router, e.g. "
         "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
         "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}'",
         default="off")


def add_limit_flags(g: argparse._ArgumentGroup) -> None:
    _add(g, "--max-queue", dest="max_queue", type=_positive, metavar="N",
         text="requests waiting for a slot before new ones get 503")
    _add(g, "--max-body-bytes", dest="max_body_bytes", type=_positive, metavar="BYTES",
         text="largest request body (413 above)")
    _add(g, "--max-messages", dest="max_messages", type=_positive, metavar="N",
         text="chat messages per request (400 above)")
    _add(g, "--max-prompt-chars", dest="max_prompt_chars", type=_non_negative, metavar="N",
         text="prompt characters per request (400 above); 0 = 32 per token of context")
    _add(g, "--max-connections", dest="max_connections", type=_positive, metavar="N",
         text="open HTTP connections at most, lowered to fit the open-file limit; past it the "
         "oldest idle one is closed, or the new one gets 503")
    _add(g, "--shutdown-timeout", dest="shutdown_timeout", type=_seconds_or_zero,
         metavar="SECONDS", text="on SIGTERM, seconds to let admitted requests finish")
    _add(g, "--timeout-header", dest="timeout_header", type=_seconds, metavar="SECONDS",
         text="seconds a client has to send a request's whole header; then the connection "
         "is closed")
    _add(g, "--timeout-body", dest="timeout_body", type=_seconds, metavar="SECONDS",
         text="seconds to wait for the next chunk of a request body; then 408")


def _names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected one or more names, got {value!r}")
    return names


class _Names(argparse.Action):
    """Repeatable, each value a comma list; the flags given replace the environment's list."""

    def __init__(self, option_strings: list[str], dest: str, **kw: object) -> None:
        kw["type"] = _names
        super().__init__(option_strings, dest, **kw)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        given = f"_{self.dest}_given"
        before = getattr(namespace, self.dest) if getattr(namespace, given, False) else ()
        setattr(namespace, self.dest, tuple(before) + tuple(values))  # type: ignore[arg-type]
        setattr(namespace, given, True)


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
    if kv_cache_type(args) is None:
        return (f"K and V share one pool type: --cache-type-k {args.cache_type_k}, --cache-type-v "
                f"{args.cache_type_v} and --kv-cache-dtype {args.kv_cache_dtype} disagree")
    if args.spec_type == "draft-simple" and args.model_draft is None:
        return "--spec-type draft-simple needs a draft model (--model-draft PATH)"
    if args.model_draft is not None and args.spec_type not in ("none", "draft-simple"):
        return (f"--model-draft drafts with --spec-type draft-simple, not {args.spec_type} "
                "(leave --spec-type out, or drop --model-draft)")
    return None


def kv_cache_type(args: ServerArgs) -> str | None:
    """The pool's type the flags name ("auto", "float32", "bfloat16", "float16"), or None where
    they name two (K and V share one pool)."""
    named = {CACHE_TYPES[args.cache_type_k], CACHE_TYPES[args.cache_type_v],
             args.kv_cache_dtype} - {"auto"}
    if len(named) > 1:
        return None
    return named.pop() if named else "auto"


def with_draft_default(args: ServerArgs) -> ServerArgs:
    """--model-draft alone turns drafting by the draft model on (as in llama-server)."""
    if args.model_draft is not None and args.spec_type == "none":
        return replace(args, spec_type="draft-simple")
    return args


def model_problem(spec: str | None, flag: str = "--model") -> str | None:
    """A model path that cannot be loaded, said before anything starts (the loader would fail
    only after the slow part of the start, with a traceback)."""
    if spec is None or spec.startswith(("builtin://", "synthetic:")):
        return None
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        return f"{flag} {spec}: no such file or directory"
    if not os.access(path, os.R_OK):
        return f"{flag} {spec}: not readable (permission denied)"
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"{flag} {spec}: a directory without config.json (not a Hugging Face model)"
        return None
    if not path.endswith(".gguf"):
        return f"{flag} {spec}: expected a .gguf file or a Hugging Face model directory"
    return None


def slot_path_problem(path: str | None, flag: str = "--slot-save-path") -> str | None:
    """A --slot-save-path (or --cache-disk) that can never hold files, said before anything
    starts (a missing directory is created at start-up, as llama-server does)."""
    if path is None:
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path}: not a directory"
    if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
        return f"{flag} {path}: not writable (permission denied)"
    return None


def parse_args(argv: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None) -> ServerArgs:
    env = os.environ if env is None else env
    parser = build_parser()
    _apply_env(parser, env)
    parsed = vars(parser.parse_args(argv))
    args = ServerArgs(**{f.name: parsed[f.name] for f in fields(ServerArgs)
                         if parsed.get(f.name) is not None})
    problem = (check(args) or model_problem(args.model)
               or model_problem(args.model_draft, "--model-draft")
               or slot_path_problem(args.slot_save_path)
               or slot_path_problem(args.cache_disk, "--cache-disk"))
    if problem:
        parser.error(problem)
    return with_draft_default(args)
