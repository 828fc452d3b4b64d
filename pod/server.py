"""Builds the serving stack from `ServerArgs`: model, pool, host store, scheduler, engine."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from kvpark.kernels import cpu_features, quant_linear, worker_pool
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.cores import usable_cores
from kvpark.kernels.cpu_features import CpuFeatures
from kvpark.kernels.kv_copy import CopyEngine, make_copy_engine
from kvpark.kernels.quant_linear import QuantizedWeight
from kvpark.kernels.torch_paged import TorchPagedAttention

from .args import ServerArgs
from .autotune import (
    choose_decode_weights,
    choose_torch_threads,
    pick_kernel_threads,
    pick_threads,
    warn_if_oversubscribed,
)
from .batch_invariance import cap_onednn, check_gemm_kernels
from .budget import MIB, Budget, resolve_budget
from .cuda_graphs import DecodeGraphRunner
from .draft_model import Drafter, check_draft
from .engine import Engine
from .generation_defaults import GenerationDefaults, defaults_for
from .host_store import HostStore
from .host_tier import HostTier
from .kv_pool import KVPool
from .metrics import Metrics
from .model.blocks_at_load import blocks_nbytes, make_missing_blocks
from .model.config import ModelConfig
from .model.llama import LlamaModel, WeightFormat
from .model.loader import LoadedModel, load_model_files
from .model.tokenizer import Tokenizer
from .preemption import UNLIMITED_BYTES
from .prefix_cache import PrefixCache
from .protocol import check_defaults
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .slot import Sequence
from .slot_files import ModelIdentity, get_source_bytes, get_weights_digest, remove_stale_temp_files
from .slot_memory import SlotMemory
from .speculation import SpecConfig
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
    """Blocks for decode rows on a float32 CPU model (`--weights auto|gguf`): a GGUF's own
    Q4_1 / Q8_0 matrices, and Q8_0 made at load for each linear stored without them."""
    if args.weights not in ("auto", "gguf"):
        return None
    reason = None
    if device.type != "cpu" or dtype != torch.float32:
        reason = "decode from blocks is a float32 CPU path"
    elif not quant_linear.is_available():
        reason = "the C kernel did not build (see --attention-backend cpu)"
    if reason is not None:
        if args.weights == "gguf":
            raise ValueError(f"--weights gguf: {reason}")
        return None
    started = time.perf_counter()
    made = make_missing_blocks(loaded.config, loaded.weights, loaded.quantized)
    if made:
        log.info("--weights %s: made Q8_0 blocks at load for %d linears the checkpoint stores "
                 "without blocks (%.0f MiB, %.1f s); %d kept as the checkpoint's own",
                 args.weights, len(made), blocks_nbytes(made) / MIB,
                 time.perf_counter() - started, len(loaded.quantized))
    return {**loaded.quantized, **made}


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


def pick_num_pages(args: ServerArgs, config: ModelConfig, num_layers: int, dtype: torch.dtype,
                   device: torch.device) -> int:
    """-c in pages; on CUDA without -c, what the free memory allows (a page holds `num_layers`
    layers: the target's and a draft model's)."""
    page_bytes = (num_layers * 2 * args.page_size * config.num_kv_heads * config.head_dim
                  * torch.empty((), dtype=dtype).element_size())
    if args.ctx_size is not None:
        return max(1, args.ctx_size // args.page_size)
    if device.type != "cuda":
        return CPU_DEFAULT_CTX // args.page_size
    free, _ = torch.cuda.mem_get_info(device)
    usable = free * args.gpu_memory_fraction - ACTIVATION_RESERVE_BYTES - FLASHINFER_RESERVE_BYTES
    return max(1, int(usable // page_bytes))


class Stages:
    """Logs each loading stage and its time: a load takes tens of seconds that would be
    silent."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()

    def done(self, what: str) -> None:
        now = time.perf_counter()
        log.info("%s: %.1f s", what, now - self.last)
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.started


def make_model(args: ServerArgs, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
               blocks: dict[str, QuantizedWeight] | None) -> LlamaModel:
    """The model over loaded weights, its linears as the flags say (the target and a draft)."""
    return LlamaModel(loaded.config, loaded.weights,
                      batch_invariant=args.batch_invariant and device.type == "cpu",
                      weight_format=pick_weight_format(args, device, dtype), quantized=blocks)


@dataclass(frozen=True)
class DraftStack:
    """The draft model (--model-draft), built like the target."""

    loaded: LoadedModel
    model: LlamaModel
    identity: str  # its weights and linears: part of the prefix cache's and slot files' keys


def build_draft(args: ServerArgs, target: LoadedModel, device: torch.device,
                dtype: torch.dtype) -> DraftStack | None:
    """Load and check the draft model; its linears as the target's (blocks for decode rows)."""
    if args.model_draft is None:
        return None
    if args.spec_draft_n_max == 0:
        log.info("--model-draft %s: not loaded, --spec-draft-n-max is 0", args.model_draft)
        return None
    loaded = load_model_files(args.model_draft, device=device, dtype=dtype)
    problem = check_draft(target.config, loaded.config, target.tokenizer, loaded.tokenizer)
    if problem is not None:
        raise ValueError(f"--model-draft {args.model_draft}: {problem}")
    digest = get_weights_digest(loaded.weights)
    model = make_model(args, loaded, device, dtype, pick_blocks(args, loaded, device, dtype))
    identity = (f"{loaded.name}|{digest}|{model.weight_format.value}"
                f"|blocks={model.has_blocks}")
    log.info("draft model %s (%s): %d layers, linears %s%s", loaded.name, loaded.source,
             loaded.config.num_layers, model.weight_format.value,
             ", decode rows from blocks" if model.has_blocks else "")
    return DraftStack(loaded, model, identity)


def make_prefix_cache(args: ServerArgs, loaded: LoadedModel, model: LlamaModel,
                      dtype: torch.dtype, draft: DraftStack | None) -> PrefixCache | None:
    """Pages are reusable only by the same weights at the same precision (a draft model's
    included: its K/V share the pages); where decode rows read other weights than prompt rows
    their K/V differ, and the hash tells them apart."""
    if not args.prefix_cache:
        return None
    identity = (f"{loaded.name}|{loaded.source}|{dtype}|{model.weight_format.value}"
                f"|blocks={model.has_blocks}|draft={draft.identity if draft else ''}")
    return PrefixCache(identity, args.page_size, split_kinds=model.has_blocks)


def scheduler_config_of(args: ServerArgs, max_context: int) -> SchedulerConfig:
    """The scheduler's slice of the flags, in its own units (watermarks as shares)."""
    return SchedulerConfig(num_slots=args.parallel, batch_size=args.batch_size,
                           preempt=args.preempt, preempt_every=args.preempt_every,
                           max_context=max_context, preempt_high=args.preempt_high / 100,
                           preempt_low=args.preempt_low / 100, resume_order=args.preempt_resume,
                           spec=SpecConfig(args.spec_type, args.spec_draft_n_max,
                                           args.spec_draft_n_min))


def make_host_tier(args: ServerArgs, pool: KVPool, host: HostStore, copy: CopyEngine
                   ) -> HostTier | None:
    """The prefix cache's host tier, inside the --preempt-ram budget; off without a prefix
    cache, with --no-host-cache, --cache-ram 0 or a budget of 0."""
    if pool.cache is None or not args.host_cache or args.cache_ram == 0 or host.budget_bytes == 0:
        log.info("host cache: off")
        return None
    cap = UNLIMITED_BYTES if args.cache_ram < 0 else args.cache_ram * MIB
    log.info("host cache: on, inside the --preempt-ram budget, %s",
             "up to what parked sequences leave" if cap == UNLIMITED_BYTES
             else f"at most {args.cache_ram} MiB")
    return HostTier(host, copy, pool.host_page_shape, pool.dtype, cap)


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
    stages.done(f"blocks for decode rows: {len(blocks)} linears" if blocks else "weights checked")
    model = make_model(args, loaded, device, dtype, blocks)
    choose_decode_weights(args, model)  # may lower the kernel threads
    choose_torch_threads(args, model)  # may raise the torch threads (prompt GEMMs)
    log.info("threads: %d torch (prompt GEMMs), %d C kernel (decode linears, attention)",
             torch.get_num_threads(), worker_pool.get_num_threads())
    warn_if_oversubscribed(torch.get_num_threads(), worker_pool.get_num_threads())
    check_gemm_kernels(model, args.batch_size)  # at the threads the steps will run with
    stages.done(f"model built ({model.weight_format.value} linears)")
    draft = build_draft(args, loaded, device, dtype)
    if draft is not None:
        stages.done(f"draft model built ({draft.loaded.config.num_layers} layers)")
    cache = make_prefix_cache(args, loaded, model, dtype, draft)
    num_layers = config.num_layers + (draft.loaded.config.num_layers if draft else 0)
    pool = KVPool(num_layers, pick_num_pages(args, config, num_layers, dtype, device),
                  args.page_size, config.num_kv_heads, config.head_dim, dtype=dtype,
                  device=device, cache=cache)
    backend = pick_backend(args, device, config, dtype)
    drafter = None if draft is None else Drafter(
        draft.model, pick_backend(args, device, draft.loaded.config, dtype),
        pool.caches[config.num_layers:], args.page_size)
    stages.done(f"attention kernel ready ({backend.name}; a C kernel is compiled on first use)")
    graphs = None
    if args.cuda_graph and device.type == "cuda" and backend.can_capture_graphs:
        graphs = DecodeGraphRunner(model, pool, backend, max_batch=args.parallel)
        graphs.capture_all()  # before the scheduler hands out pages: it takes a scratch page
        stages.done(f"CUDA graphs captured for batch buckets {graphs.buckets}")
    budget = resolve_budget(args.preempt_ram)  # after the load: auto subtracts resident size
    host = HostStore(budget.bytes, pin_memory=device.type == "cuda",
                     fail_allocations=args.preempt_fail_swap)
    # without max_tokens a sequence ends ("length") at the model's context or when it alone
    # fills the whole pool, whichever comes first
    scheduler_config = scheduler_config_of(args, min(config.max_position, pool.capacity_tokens))
    copy = make_copy_engine(pool, args.preempt_async)
    pool.tier = make_host_tier(args, pool, host, copy)
    swapper = Swapper(pool, host, copy)
    scheduler = Scheduler(scheduler_config, swapper)
    lock = threading.RLock()  # the engine's: the metrics collector reads state under it
    served = args.served_model_name[0] if args.served_model_name else loaded.name
    metrics = Metrics(scheduler, host, swapper.copy_times, lock, model_name=served)
    memory = SlotMemory(pool, args.parallel)

    def on_finish(seq: Sequence) -> None:
        metrics.on_finish(seq)
        memory.remember(seq)  # the slot's last sequence, for POST /slots/{id}?action=save

    scheduler.on_finish = on_finish
    runner = ModelRunner(model, pool, backend, graphs=graphs,
                         fault_token=args.inject_fault_token, drafter=drafter)
    engine = Engine(scheduler, runner, loaded.tokenizer.eos_token_ids, on_step=metrics.on_step,
                    lock=lock, memory=memory, tokenizer=loaded.tokenizer)
    log.info("model %s (%s): %d layers, %d/%d heads, %s on %s, linears %s%s", loaded.name,
             loaded.source, config.num_layers, config.num_heads, config.num_kv_heads, dtype,
             device, model.weight_format.value,
             ", decode rows from blocks" if model.has_blocks else "")
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
    log.info("speculative decoding %s", f"{args.spec_type}, drafts of "
             f"{args.spec_draft_n_min}..{args.spec_draft_n_max} tokens"
             + (f" by {draft.loaded.name}" if draft else "")
             if scheduler_config.spec.enabled else "off")
    log.info("sampling defaults: %s", defaults.describe())
    identity = ModelIdentity(loaded.name, get_source_bytes(loaded.source), weights_digest,
                             str(dtype).removeprefix("torch."), model.weight_format.value,
                             model.has_blocks, len(pool.caches), config.num_kv_heads,
                             config.head_dim, args.page_size,
                             draft=draft.identity if draft else "")
    if args.slot_save_path:
        os.makedirs(args.slot_save_path, exist_ok=True)
        stale = remove_stale_temp_files(args.slot_save_path)
        log.info("slot files in %s%s", os.path.realpath(args.slot_save_path),
                 f"; removed {len(stale)} temporary files of saves that never finished"
                 if stale else "")
    log.info("model loaded in %.1f s", stages.total)
    numerics = (f"{loaded.name}|{loaded.source}|{device}|{dtype}|{model.weight_format.value}"
                f"|blocks={model.has_blocks}|{backend.name}|invariant={model.batch_invariant}")
    return ServingStack(args, loaded.name, loaded.tokenizer, scheduler_config.max_context,
                        scheduler, engine, metrics, budget, model_path=loaded.source,
                        defaults=defaults, numerics=numerics,
                        identity=identity, kv_dtype=dtype)
