"""Builds the serving stack from `ServerArgs`: model, pool, host store, scheduler, engine."""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvpark.kernels import cpu_features, quant_linear, worker_pool
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.cores import usable_cores
from kvpark.kernels.cpu_features import CpuFeatures
from kvpark.kernels.kv_copy import make_copy_engine
from kvpark.kernels.quant_linear import QuantizedWeight
from kvpark.kernels.torch_paged import TorchPagedAttention

from .args import MAX_TORCH_THREADS, ServerArgs
from .batch_invariance import cap_onednn, check_gemm_kernels
from .budget import Budget, resolve_budget
from .cuda_graphs import DecodeGraphRunner, GraphBackend
from .engine import Engine
from .generation_defaults import GenerationDefaults, defaults_for
from .host_store import HostStore
from .kv_pool import KVPool
from .metrics import Metrics
from .model.config import ModelConfig
from .model.llama import MIN_INVARIANT_ROWS, LlamaModel, WeightFormat, pad_rows
from .model.loader import LoadedModel, load_model_files
from .model.tokenizer import Tokenizer
from .prefix_cache import PrefixCache
from .protocol import check_defaults
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .slot import Sequence
from .slot_files import ModelIdentity, get_source_bytes, get_weights_digest
from .slot_memory import SlotMemory
from .swap import Swapper

log = logging.getLogger("kvpark.server")


@dataclass
class ServingStack:
    args: ServerArgs
    model_name: str
    tokenizer: Tokenizer
    max_context: int
    scheduler: Scheduler
    engine: Engine
    metrics: Metrics
    budget: Budget
    model_path: str = ""  # the file or directory the weights came from (/props, /v1/models)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # what decides the numbers: weights, precision, kernels (system_fingerprint hashes it)
    numerics: str = ""
    identity: ModelIdentity | None = None  # what a slot file must have been saved by
    kv_dtype: torch.dtype = torch.float32  # the pool's (a slot file's pages)


def pick_device(args: ServerArgs) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def pick_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def pick_weight_format(args: ServerArgs, device: torch.device, dtype: torch.dtype,
                       cpu: CpuFeatures | None = None) -> WeightFormat:
    """bf16 linears are a CPU option over a float32 model (on CUDA the dtype says it all); a CPU
    without oneDNN's bf16 GEMMs keeps float32 (unpacked bf16 GEMMs there are slower than it)."""
    if args.weights != "bf16" or device.type != "cpu" or dtype != torch.float32:
        return WeightFormat.FP32
    cpu = cpu or cpu_features.detect()
    if not cpu.can_bf16_gemm:
        log.warning("--weights bf16: this CPU has no bf16 GEMMs for oneDNN (they need AVX-512 "
                    "BW/VL/DQ or AVX-NE-CONVERT; %s); using fp32 linears", cpu.describe())
        return WeightFormat.FP32
    return WeightFormat.BF16


def pick_blocks(args: ServerArgs, loaded: LoadedModel, device: torch.device,
                dtype: torch.dtype) -> dict[str, QuantizedWeight] | None:
    """A GGUF's own blocks for decode rows on a float32 CPU model (`--weights auto|gguf`)."""
    if args.weights not in ("auto", "gguf"):
        return None
    reason = None
    if not loaded.quantized:
        reason = "the checkpoint has no Q4_1 / Q8_0 matrices"
    elif device.type != "cpu" or dtype != torch.float32:
        reason = "decode from blocks is a float32 CPU path"
    elif not quant_linear.is_available():
        reason = "the C kernel did not build (see --attention-backend cpu)"
    if reason is None:
        return loaded.quantized
    if args.weights == "gguf":
        raise ValueError(f"--weights gguf: {reason}")
    return None


AUTO_ROUNDS = 8
AUTO_BUDGET_S = 0.6  # the start-up measurement stops after this much time
BUSY_SPREAD = 0.15  # a variant's median round this much slower than its best: others ran too


@dataclass(frozen=True)
class Conditions:
    """What the machine was like while a start-up measurement ran: a loaded machine measures
    thread counts wrong (a second thread waits for a core), and the log must say so."""

    load_average: float  # the 1-minute load average as the measurement ended
    cores: int
    spread: float  # the largest median/best - 1 of any variant's rounds
    rounds: int

    @property
    def busy(self) -> bool:
        return self.load_average >= self.cores or self.spread > BUSY_SPREAD

    def describe(self) -> str:
        text = (f"{self.rounds} round{'s' * (self.rounds > 1)}, median {self.spread:.0%} over "
                f"the best; load average {self.load_average:.2f} on {self.cores} cores")
        if self.busy:
            text += ("; the machine was busy while measuring, so on an idle one this may "
                     "choose otherwise (set the flag to decide)")
        return text


@dataclass(frozen=True)
class Rounds:
    times: dict[int, list[float]]  # seconds of each timed round, by variant

    @property
    def best(self) -> dict[int, float]:
        return {variant: min(times) for variant, times in self.times.items()}

    def conditions(self) -> Conditions:
        spread = max((statistics.median(t) / min(t) - 1 for t in self.times.values() if min(t)),
                     default=0.0)
        return Conditions(os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
                          usable_cores().count, spread,
                          min(len(t) for t in self.times.values()))


def timed_rounds(run: Callable[[int], float], variants: list[int]) -> Rounds:
    """`run(variant)` once each to warm up, then in alternating rounds (so that a change in the
    machine's load hits every variant alike) until AUTO_ROUNDS or AUTO_BUDGET_S."""
    for variant in variants:  # first touches: caches, the pools' workers
        run(variant)
    times: dict[int, list[float]] = {variant: [] for variant in variants}
    deadline = time.perf_counter() + AUTO_BUDGET_S
    for _ in range(AUTO_ROUNDS):
        for variant in variants:
            times[variant].append(run(variant))
        if time.perf_counter() > deadline:
            break
    return Rounds(times)


@dataclass(frozen=True)
class DecodeTimings:
    """Seconds for one decode row through every layer's MLP linears (most of a step's bytes):
    from the GGUF's blocks by kernel thread count, and float32 oneDNN."""

    blocks: dict[int, float]
    dense: float
    conditions: Conditions

    @property
    def best_threads(self) -> int:
        """More threads only where they save 5%: a second thread costs CPU time."""
        fewest = min(self.blocks)
        faster = [n for n, t in self.blocks.items() if t < 0.95 * self.blocks[fewest]]
        return min(faster, key=self.blocks.__getitem__, default=fewest)


def measure_decode_linears(model: LlamaModel, thread_counts: list[int]) -> DecodeTimings:
    """The block kernel at each thread count vs float32 oneDNN on this machine, in alternating
    rounds (best of each): all layers' MLP weights outgrow the caches, as a decode step does."""
    layers = [layer for layer in model.layers
              if layer.gate_up.blocks is not None and layer.down.blocks is not None]
    x = torch.randn(1, model.config.hidden_size)
    mid = torch.randn(1, model.config.intermediate_size)

    def run(threads: int) -> float:  # 0: the dense GEMMs
        worker_pool.set_num_threads(max(1, threads))
        start = time.perf_counter()
        for layer in layers:
            if threads:
                layer.gate_up.from_blocks(x), layer.down.from_blocks(mid)
            else:  # the dense decode GEMM pads to MIN_INVARIANT_ROWS rows (see `Linear`)
                layer.gate_up.dense(pad_rows(x, MIN_INVARIANT_ROWS))
                layer.down.dense(pad_rows(mid, MIN_INVARIANT_ROWS))
        return time.perf_counter() - start

    variants = [*dict.fromkeys(thread_counts), 0]
    before = worker_pool.get_num_threads()
    with torch.inference_mode():
        rounds = timed_rounds(run, variants)
    worker_pool.set_num_threads(before)
    best = rounds.best
    return DecodeTimings({n: best[n] for n in variants if n}, best[0], rounds.conditions())


def choose_decode_weights(args: ServerArgs, model: LlamaModel) -> None:
    """By measurement on this machine: `--weights auto` keeps decode rows on the GGUF's blocks
    only where they are faster than float32 (slower on an AVX2 EPYC, faster on AVX-512:
    benchmarks/README.md); `--kernel-threads 0` takes more threads only where they are
    faster."""
    auto_threads = args.kernel_threads == 0
    if not model.has_blocks or (args.weights != "auto" and not auto_threads):
        return
    counts = [1, worker_pool.get_num_threads()] if auto_threads else [args.kernel_threads]
    timings = measure_decode_linears(model, counts)
    if auto_threads:
        worker_pool.set_num_threads(timings.best_threads)
    blocks = timings.blocks[worker_pool.get_num_threads()]
    keep = args.weights != "auto" or blocks <= timings.dense
    log.info("--weights %s, --kernel-threads %s: decode rows from %s, kernel threads %d (one row "
             "through every layer's MLP: GGUF blocks %s, float32 oneDNN %.2f ms; %s)",
             args.weights, "auto" if auto_threads else args.kernel_threads,
             "the GGUF's blocks" if keep else "float32 (faster here)",
             worker_pool.get_num_threads(),
             ", ".join(f"{t * 1e3:.2f} ms at {n} thread{'s' * (n > 1)}"
                       for n, t in timings.blocks.items()), timings.dense * 1e3,
             timings.conditions.describe())
    if not keep:
        model.drop_blocks()


PROMPT_PROBE_ROWS = 64  # a prompt chunk's worth of rows through a few layers' MLPs
PROMPT_PROBE_LAYERS = 4
PROMPT_THREADS_GAIN = 1.3  # more torch threads only where a prompt GEMM is 30% faster


@dataclass(frozen=True)
class PromptTimings:
    """Seconds for a prompt chunk's GEMMs by torch thread count."""

    by_threads: dict[int, float]
    conditions: Conditions


def measure_prompt_gemms(model: LlamaModel, thread_counts: list[int]) -> PromptTimings:
    """Seconds for a prompt chunk through a few layers' MLP GEMMs (float32 oneDNN, as prompt rows
    take them) at each torch thread count, alternating rounds, best of each."""
    layers = model.layers[:PROMPT_PROBE_LAYERS]
    x = torch.randn(PROMPT_PROBE_ROWS, model.config.hidden_size)
    mid = torch.randn(PROMPT_PROBE_ROWS, model.config.intermediate_size)

    def run(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        for layer in layers:
            layer.gate_up.dense(x), layer.down.dense(mid)
        return time.perf_counter() - start

    before = torch.get_num_threads()
    with torch.inference_mode():
        rounds = timed_rounds(run, thread_counts)
    torch.set_num_threads(before)
    return PromptTimings(rounds.best, rounds.conditions())


def choose_torch_threads(args: ServerArgs, model: LlamaModel) -> None:
    """`--threads 0` on the CPU with decode rows in the C kernels: every core for the prompt
    GEMMs where a start-up measurement finds them 30% faster than one thread (on a machine busy
    at start-up one thread stays; measurements in benchmarks/README.md).
    Decode steps of block rows make few torch calls, so the extra OpenMP thread costs them
    nothing measurable; without blocks (float32 decode in torch ops) half the cores stay, as
    `pick_threads` says why."""
    cores = min(usable_cores().count, MAX_TORCH_THREADS)
    if args.threads != 0 or not model.has_blocks or model.device.type != "cpu" or cores < 2:
        return
    timings = measure_prompt_gemms(model, [1, cores])
    one, every = timings.by_threads[1], timings.by_threads[cores]
    chosen = cores if every * PROMPT_THREADS_GAIN < one else 1
    torch.set_num_threads(chosen)
    log.info("--threads auto: %d torch thread%s for prompt GEMMs (a %d-row chunk through %d "
             "layers' MLPs: %.2f ms at 1 thread, %.2f ms at %d; %s)", chosen, "s" * (chosen > 1),
             PROMPT_PROBE_ROWS, PROMPT_PROBE_LAYERS, one * 1e3, every * 1e3, cores,
             timings.conditions.describe())


def warn_if_oversubscribed(torch_threads: int, kernel_threads: int) -> None:
    """More threads than cores only slows a step down: each one waits for its slowest thread,
    and a thread off the CPU holds it up for a whole time slice."""
    cores = usable_cores()
    if max(torch_threads, kernel_threads) > cores.count:
        log.warning("%d torch and %d C kernel threads on %d cores this process may keep busy "
                    "(%s): steps run slower than with at most %d (--threads, --kernel-threads)",
                    torch_threads, kernel_threads, cores.count, cores.source, cores.count)


def pick_kernel_threads(args: ServerArgs) -> int:
    """The count to use, or with 0 (auto) the most to try: every core."""
    return args.kernel_threads if args.kernel_threads > 0 else worker_pool.default_num_threads()


def pick_threads(args: ServerArgs) -> int:
    # Half the cores, measured on a 2-core machine shared with other jobs (benchmarks/README.md,
    # "CPU decode step"): every core made a small decode step slower and cost much more CPU; a
    # GEMM pass that must wait for a descheduled thread waits for all. Batch invariance holds
    # at any count (oneDNN linears).
    return args.threads if args.threads > 0 else max(1, usable_cores().count // 2)


CPU_DEFAULT_CTX = 8192
ACTIVATION_RESERVE_BYTES = 1 << 30  # CUDA: activations, sampling, graph pool
FLASHINFER_RESERVE_BYTES = (128 + 8 * 8) << 20  # workspace + per-wrapper buffers


def pick_backend(args: ServerArgs, device: torch.device, config: ModelConfig,
                 dtype: torch.dtype) -> AttentionBackend:
    if args.attention_backend in ("auto", "flashinfer") and device.type == "cuda":
        try:
            from kvpark.kernels.flashinfer_paged import AttentionShape, FlashInferPagedAttention

            shape = AttentionShape(config.num_heads, config.num_kv_heads, config.head_dim,
                                   args.page_size, dtype, dtype)
            return FlashInferPagedAttention(device, shape=shape)
        except ImportError as exc:  # FlashInferUnavailable is an ImportError too
            if args.attention_backend == "flashinfer":
                raise
            log.warning("FlashInfer unavailable (%s); using the torch backend", exc)
    if args.attention_backend == "flashinfer":
        raise ValueError("--attention-backend flashinfer needs a CUDA device")
    if args.attention_backend in ("auto", "cpu") and device.type == "cpu":
        return pick_cpu_backend(args, dtype)
    if args.attention_backend == "cpu":
        raise ValueError("--attention-backend cpu runs on the CPU only")
    return TorchPagedAttention(device)


def pick_cpu_backend(args: ServerArgs, dtype: torch.dtype) -> AttentionBackend:
    """The C kernel (reads pages in place) where it builds; the torch reference otherwise."""
    from kvpark.kernels.cpu_paged import CpuPagedAttention, KernelUnavailable

    if dtype != torch.float32:
        if args.attention_backend == "cpu":
            raise ValueError("--attention-backend cpu computes in float32 only")
        return TorchPagedAttention("cpu")
    try:
        return CpuPagedAttention()
    except KernelUnavailable as exc:
        if args.attention_backend == "cpu":
            raise
        log.warning("C paged attention unavailable (%s); using the torch backend", exc)
        return TorchPagedAttention("cpu")


def pick_num_pages(args: ServerArgs, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device) -> int:
    """-c in pages; on CUDA without -c, what the free memory allows."""
    page_bytes = (config.num_layers * 2 * args.page_size * config.num_kv_heads * config.head_dim
                  * torch.empty((), dtype=dtype).element_size())
    if args.ctx_size is not None:
        return max(1, args.ctx_size // args.page_size)
    if device.type != "cuda":
        return CPU_DEFAULT_CTX // args.page_size
    free, _ = torch.cuda.mem_get_info(device)
    usable = free * args.gpu_memory_fraction - ACTIVATION_RESERVE_BYTES - FLASHINFER_RESERVE_BYTES
    return max(1, int(usable // page_bytes))


class Stages:
    """Logs each loading stage and its time: a load takes 20-60 s that would be silent."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        log.info("%s: %.1f s", what, now - self.last)
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.started


def build_stack(args: ServerArgs) -> ServingStack:
    stages = Stages()
    defaults = defaults_for(args)  # a bad generation config fails before the weights load
    check_defaults(defaults)
    device = pick_device(args)
    # first: oneDNN reads its ISA cap once, when anything first asks (cpu_features.detect does)
    cap_onednn(args.batch_invariant and device.type == "cpu")
    cores = usable_cores()
    log.info("cores: %d (%s)", cores.count, cores.source)
    torch.set_num_threads(pick_threads(args))
    worker_pool.set_num_threads(pick_kernel_threads(args))
    dtype = pick_dtype(args, device)
    if device.type == "cpu":
        cpu_features.detect()  # logs what the CPU paths below are chosen from
    log.info("loading model %s on %s (%s); the server answers 503 until it is ready",
             args.model or "builtin://smollm2-135m", device, dtype)
    loaded: LoadedModel = load_model_files(args.model, device=device, dtype=dtype)
    stages.done(f"weights read: {len(loaded.weights)} tensors, {len(loaded.quantized)} also "
                "kept as quantised blocks")
    if args.chat_template:  # --chat-template: the file wins over the model's own template
        with open(args.chat_template, encoding="utf-8") as file:
            loaded.tokenizer.set_chat_template(file.read())
        log.info("chat template from %s", args.chat_template)
    config = loaded.config
    weights_digest = get_weights_digest(loaded.weights)  # before the model takes the weights
    blocks = pick_blocks(args, loaded, device, dtype)  # builds the C kernel on first use
    stages.done("quantised-linear kernel checked" if loaded.quantized else "weights checked")
    model = LlamaModel(config, loaded.weights,
                       batch_invariant=args.batch_invariant and device.type == "cpu",
                       weight_format=pick_weight_format(args, device, dtype),
                       quantized=blocks)
    choose_decode_weights(args, model)  # may lower the kernel threads
    choose_torch_threads(args, model)  # may raise the torch threads (prompt GEMMs)
    log.info("threads: %d torch (prompt GEMMs), %d C kernel (decode linears, attention)",
             torch.get_num_threads(), worker_pool.get_num_threads())
    warn_if_oversubscribed(torch.get_num_threads(), worker_pool.get_num_threads())
    check_gemm_kernels(model, args.batch_size)  # at the threads the steps will run with
    stages.done(f"model built ({model.weight_format.value} linears)")
    cache = None
    if args.prefix_cache:
        # pages are reusable only by the same weights at the same precision; where decode rows
        # read other weights than prompt rows their K/V differ, and the hash tells them apart
        identity = (f"{loaded.name}|{loaded.source}|{dtype}|{model.weight_format.value}"
                    f"|blocks={model.has_blocks}")
        cache = PrefixCache(identity, args.page_size, split_kinds=model.has_blocks)
    pool = KVPool(config.num_layers, pick_num_pages(args, config, dtype, device), args.page_size,
                  config.num_kv_heads, config.head_dim, dtype=dtype, device=device, cache=cache)
    backend = pick_backend(args, device, config, dtype)
    stages.done(f"attention kernel ready ({backend.name}; a C kernel is compiled on first use)")
    graphs = None
    if args.cuda_graph and device.type == "cuda" and isinstance(backend, GraphBackend):
        graphs = DecodeGraphRunner(model, pool, backend, max_batch=args.parallel)
        graphs.capture_all()  # before the scheduler hands out pages: it takes a scratch page
        stages.done(f"CUDA graphs captured for batch buckets {graphs.buckets}")
    budget = resolve_budget(args.preempt_ram)  # after the load: auto subtracts resident size
    host = HostStore(budget.bytes, pin_memory=device.type == "cuda",
                     fail_allocations=args.preempt_fail_swap)
    scheduler_config = SchedulerConfig(
        num_slots=args.parallel,
        batch_size=args.batch_size,
        preempt=args.preempt,
        preempt_every=args.preempt_every,
        # without max_tokens a sequence ends ("length") at the model's context or when it
        # alone fills the whole pool, whichever comes first
        max_context=min(config.max_position, pool.capacity_tokens),
        preempt_high=args.preempt_high / 100,
        preempt_low=args.preempt_low / 100,
        resume_order=args.preempt_resume,
    )
    swapper = Swapper(pool, host, make_copy_engine(pool, args.preempt_async))
    scheduler = Scheduler(scheduler_config, swapper)
    lock = threading.RLock()  # the engine's: the metrics collector reads state under it
    served = args.served_model_name[0] if args.served_model_name else loaded.name
    metrics = Metrics(scheduler, lock, model_name=served)
    memory = SlotMemory(pool, args.parallel)

    def on_finish(seq: Sequence) -> None:
        metrics.on_finish(seq)
        memory.remember(seq)  # the slot's last sequence, for POST /slots/{id}?action=save

    scheduler.on_finish = on_finish
    runner = ModelRunner(model, pool, backend, graphs=graphs,
                         fault_token=args.inject_fault_token)
    engine = Engine(scheduler, runner, loaded.tokenizer.eos_token_ids, on_step=metrics.on_step,
                    lock=lock, memory=memory)
    log.info("model %s (%s): %d layers, %d/%d heads, %s on %s, linears %s%s", loaded.name,
             loaded.source, config.num_layers, config.num_heads, config.num_kv_heads, dtype,
             device, model.weight_format.value,
             ", decode rows from the GGUF's blocks" if model.has_blocks else "")
    log.info("KV pool: %d pages x %d tokens = %d tokens, %.1f MiB; %d slots", pool.num_pages,
             pool.page_size, pool.capacity_tokens, pool.page_bytes * pool.num_pages / 2**20,
             args.parallel)
    log.info("attention backend %s%s", backend.name,
             f", CUDA graphs for batch buckets {graphs.buckets}" if graphs else "")
    log.info("preemption %s; preempt-ram budget %s; preempt-every %d; watermarks %g%%/%g%%; "
             "resume order %s", "on" if args.preempt else "off (--no-preempt)",
             budget.describe(), args.preempt_every, args.preempt_high, args.preempt_low,
             args.preempt_resume)
    log.info("prefix cache %s", "on" if cache else "off (--no-prefix-cache)")
    log.info("sampling defaults: %s", defaults.describe())
    identity = ModelIdentity(loaded.name, get_source_bytes(loaded.source), weights_digest,
                             str(dtype).removeprefix("torch."), model.weight_format.value,
                             model.has_blocks, config.num_layers, config.num_kv_heads,
                             config.head_dim, args.page_size)
    if args.slot_save_path:
        os.makedirs(args.slot_save_path, exist_ok=True)
        log.info("slot files in %s", os.path.realpath(args.slot_save_path))
    log.info("model loaded in %.1f s", stages.total)
    numerics = (f"{loaded.name}|{loaded.source}|{device}|{dtype}|{model.weight_format.value}"
                f"|blocks={model.has_blocks}|{backend.name}|invariant={model.batch_invariant}")
    return ServingStack(args, loaded.name, loaded.tokenizer, scheduler_config.max_context,
                        scheduler, engine, metrics, budget, model_path=loaded.source,
                        defaults=defaults, numerics=numerics,
                        identity=identity, kv_dtype=dtype)
