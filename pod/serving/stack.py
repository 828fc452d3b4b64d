"""Builds the serving stack from `ServerArgs`, in phases: the machine (threads, oneDNN's cap), the
model (and a draft model), memory (identity, prefix cache, pool, host store and tier), the
engine (scheduler, runner, metrics); what each flag chooses is `choices.py`'s."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from kvpark.kernels import cpu_features, worker_pool
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.cores import usable_cores
from kvpark.kernels.kv_copy import CopyEngine, make_copy_engine

from ..args import ServerArgs
from ..core.engine import Engine
from ..core.scheduler import Scheduler, SchedulerConfig
from ..core.sequence import Sequence
from ..core.slot_memory import SlotMemory
from ..core.speculation import SpecConfig
from ..core.swap import Swapper
from ..memory.budget import MIB, UNLIMITED_BYTES, Budget, resolve_budget
from ..memory.checkpoints import CheckpointStore
from ..memory.host_store import HostStore
from ..memory.host_tier import HostTier
from ..memory.identity import ModelIdentity, get_source_bytes, get_weights_digest
from ..memory.kv_events import KvEventLog
from ..memory.kv_pool import KVPool
from ..memory.prefix_cache import PrefixCache
from ..memory.slot_files import remove_stale_temp_files
from ..memory.state_pool import StatePart, StatePool
from ..metrics.prometheus import Metrics
from ..model.config import ModelConfig
from ..model.linear import block_layout, gemm_engine
from ..model.llama import LlamaModel
from ..model.loader import LoadedModel, load_model_files
from ..model.mtp import MTPHead
from ..model.tokenizer import Tokenizer
from ..requests.generation_defaults import GenerationDefaults, defaults_for
from ..requests.parsers import check_defaults
from ..worker.autotune import (
    choose_decode_weights,
    choose_torch_threads,
    pick_kernel_threads,
    pick_threads,
    warn_if_oversubscribed,
)
from ..worker.batch_invariance import cap_onednn, check_gemm_kernels
from ..worker.cuda_graphs import DecodeGraphRunner
from ..worker.draft_model import Drafter, check_draft
from ..worker.mtp_drafter import MTPDrafter
from ..worker.runner import ModelRunner
from .choices import (
    make_model,
    make_mtp_head,
    pick_backend,
    pick_blocks,
    pick_device,
    pick_dtype,
    pick_kv_dtype,
    pick_num_pages,
    pick_prefill_first,
)
from .disk_cache import make_disk_tier, write_out
from .kv_event_publisher import KvEventOutlet, KvEventsConfig, ZmqEventPublisher
from .kv_event_publisher import parse_config as parse_kv_events_config

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
    numerics: str = ""  # ModelIdentity.fingerprint: what decides the output's numbers
    identity: ModelIdentity | None = None  # what a slot file must have been saved by
    kv_dtype: torch.dtype = torch.float32  # the pool's (a slot file's pages)
    state_layout: tuple[StatePart, ...] = ()  # a hybrid's state slot (a slot file's state)


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


@dataclass(frozen=True)
class DraftStack:
    """The draft model (--model-draft), built like the target."""

    loaded: LoadedModel
    model: LlamaModel
    weights_key: str  # its weights and linears: its part of the target's ModelIdentity


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
    identity = identity_of(loaded, model, digest, dtype, loaded.config.num_layers,
                           args.page_size)
    log.info("draft model %s (%s): %d layers, linears %s%s", loaded.name, loaded.source,
             loaded.config.num_layers, model.weight_format.value,
             ", decode rows from blocks" if model.has_blocks else "")
    return DraftStack(loaded, model, identity.weights_key)


def identity_of(loaded: LoadedModel, model: LlamaModel, weights_digest: str, dtype: torch.dtype,
                num_layers: int, page_size: int, draft_key: str = "",
                kv_dtype: torch.dtype | None = None) -> ModelIdentity:
    """The one identity of what computed the pool's K/V (the target's, with a draft model's
    or the MTP head's weights when there is one: `draft_key`) and the type they are kept in
    (`kv_dtype`; None: the compute type)."""
    def name(t: torch.dtype) -> str:
        return str(t).removeprefix("torch.")

    return ModelIdentity(loaded.name, get_source_bytes(loaded.source), weights_digest,
                         name(dtype), model.weight_format.value,
                         model.has_blocks, num_layers, loaded.config.num_kv_heads,
                         loaded.config.head_dim, page_size,
                         draft=draft_key,
                         state_layout=state_layout_of(loaded.config),
                         kv_dtype="" if kv_dtype in (None, dtype) else name(kv_dtype))


def state_layout_of(config: ModelConfig) -> str:
    if not config.is_hybrid:
        return ""
    return config.delta_net.state_layout(len(config.delta_net_layers))


def make_prefix_cache(args: ServerArgs, model: LlamaModel, identity: ModelIdentity
                      ) -> PrefixCache | None:
    """Pages are reusable only under the same identity (a draft model's included: its K/V
    share the pages); where decode rows read other weights than prompt rows their K/V differ,
    and the hash tells them apart."""
    if not args.prefix_cache:
        return None
    return PrefixCache(identity.text, args.page_size, split_kinds=model.has_blocks)


def scheduler_config_of(args: ServerArgs, max_context: int, device: torch.device
                        ) -> SchedulerConfig:
    """The scheduler's slice of the flags, in its own units (watermarks as shares)."""
    return SchedulerConfig(num_slots=args.parallel, batch_size=args.batch_size,
                           prefill_first=pick_prefill_first(args, device),
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


@dataclass(frozen=True)
class Target:
    """The target model as loaded and built, and what its identity needs of it."""

    loaded: LoadedModel
    model: LlamaModel
    weights_digest: str
    mtp: MTPHead | None = None  # --spec-type draft-mtp: the model's own drafter
    mtp_key: str = ""  # its weights: its part of the identity


@dataclass(frozen=True)
class Memory:
    """The pool and what reads it: the prefix cache's identity, the attention backends, a
    draft model's pass, the CUDA graphs."""

    identity: ModelIdentity
    pool: KVPool
    backend: AttentionBackend
    drafter: Drafter | None
    graphs: DecodeGraphRunner | None


def build_stack(args: ServerArgs) -> ServingStack:
    stages = Stages()
    defaults = defaults_for(args)  # a bad generation config fails before the weights load
    check_defaults(defaults)
    if args.kv_events_config is not None:  # its keys, before the weights load too
        kv_events_config(args.kv_events_config)
    device = pick_device(args)
    prepare_machine(args, device)
    dtype = pick_dtype(args, device)
    pick_kv_dtype(args, device, dtype)  # a type the pool cannot take fails before the load
    target = load_target(args, device, dtype, stages)
    draft = build_draft(args, target.loaded, device, dtype)
    if draft is not None:
        stages.done(f"draft model built ({draft.loaded.config.num_layers} layers)")
    memory = build_memory(args, target, draft, device, dtype, stages)
    budget = resolve_budget(args.preempt_ram)  # after the load: auto subtracts resident size
    engine, metrics = build_engine(args, target, memory, budget, device)
    kernels = (f"{device}|{memory.backend.name}|invariant={target.model.batch_invariant}"
               f"|gemm={gemm_engine(target.model.weight_format, device)}"
               f"|blocks={block_layout(target.model.weight_format, device)}")
    memory.pool.disk = make_disk_tier(args, memory.pool, memory.identity, kernels)
    log_summary(args, target, memory, draft, budget, engine.scheduler.config, defaults)
    prepare_slot_files(args)
    log.info("model loaded in %.1f s", stages.total)
    return ServingStack(args, target.loaded.name, target.loaded.tokenizer,
                        engine.scheduler.config.max_context, engine.scheduler, engine, metrics,
                        budget, model_path=target.loaded.source, defaults=defaults,
                        numerics=memory.identity.fingerprint(kernels), identity=memory.identity,
                        kv_dtype=memory.pool.dtype,
                        state_layout=memory.pool.states.layout if memory.pool.states else ())


def stop_stack(stack: ServingStack) -> None:
    """After the drain: the engine stopped, then what the disk tier lacks written out."""
    stack.engine.stop()
    write_out(stack.scheduler.pool, stack.args.cache_disk_write_out)


def prepare_machine(args: ServerArgs, device: torch.device) -> None:
    """oneDNN's ISA cap (before anything first asks oneDNN), the cores and the threads."""
    cap_onednn(args.batch_invariant and device.type == "cpu")
    cores = usable_cores()
    log.info("cores: %d (%s)", cores.count, cores.source)
    torch.set_num_threads(pick_threads(args))
    worker_pool.set_num_threads(pick_kernel_threads(args))
    if device.type == "cpu":
        cpu_features.detect()  # logs what the CPU paths below are chosen from


def load_target(args: ServerArgs, device: torch.device, dtype: torch.dtype,
                stages: Stages) -> Target:
    """The model's files read and the model built, with the start-up measurements that pick
    its linears and threads."""
    log.info("loading model %s on %s (%s); the server answers 503 until it is ready",
             args.model or "builtin://smollm2-135m", device, dtype)
    loaded: LoadedModel = load_model_files(args.model, device=device, dtype=dtype)
    stages.done(f"weights read: {len(loaded.weights)} tensors, {len(loaded.quantized)} also "
                "kept as quantised blocks")
    if args.chat_template:  # --chat-template: the file wins over the model's own template
        with open(args.chat_template, encoding="utf-8") as file:
            loaded.tokenizer.set_chat_template(file.read())
        log.info("chat template from %s", args.chat_template)
    loaded.tokenizer.prepare_chat()  # else the first chat request builds it on its way in
    weights_digest = get_weights_digest(loaded.weights)  # before the model takes the weights
    blocks = pick_blocks(args, loaded, device, dtype)  # builds the C kernel on first use
    stages.done(f"blocks for decode rows: {len(blocks)} linears" if blocks else "weights checked")
    model = make_model(args, loaded, device, dtype, blocks)
    # the model holds the blocks it reads (laid out anew where AMX tiles take them): the file's
    # own copies would stay beside them for the server's life
    loaded.quantized.clear()
    del blocks
    mtp, mtp_key = make_mtp_head(args, loaded, model)
    choose_decode_weights(args, model)  # may lower the kernel threads
    choose_torch_threads(args, model)  # may raise the torch threads (prompt GEMMs)
    log.info("threads: %d torch (prompt GEMMs), %d C kernel (decode linears, attention)",
             torch.get_num_threads(), worker_pool.get_num_threads())
    warn_if_oversubscribed(torch.get_num_threads(), worker_pool.get_num_threads())
    check_gemm_kernels(model, args.batch_size)  # at the threads the steps will run with
    stages.done(f"model built ({model.weight_format.value} linears)")
    return Target(loaded, model, weights_digest, mtp, mtp_key)


def build_memory(args: ServerArgs, target: Target, draft: DraftStack | None,
                 device: torch.device, dtype: torch.dtype, stages: Stages) -> Memory:
    config = target.loaded.config
    num_attention = len(config.attention_layers)  # a hybrid's DeltaNet layers have no pages
    num_drafting = (draft.loaded.config.num_layers if draft else 0) + (1 if target.mtp else 0)
    num_layers = num_attention + num_drafting  # a draft model's or the MTP head's after them

    def prompt_rows_on_amx(model: LlamaModel) -> bool:
        return gemm_engine(model.weight_format, device) == "amx"

    backend = pick_backend(args, device, config, dtype, prompt_rows_on_amx(target.model))
    # the C backend's prompt rows on AMX read K and V as bf16: the pool keeps them so by default
    kv_dtype = pick_kv_dtype(args, device, dtype, backend.amx_prompt_rows)
    identity = identity_of(target.loaded, target.model, target.weights_digest, dtype,
                           num_layers, args.page_size,
                           draft.weights_key if draft else target.mtp_key, kv_dtype)
    states = make_state_pool(args, config, dtype, device)
    state_bytes = states.total_bytes + checkpoint_pool_slots(args) * states.slot_bytes \
        if states else 0
    pool = KVPool(num_layers, pick_num_pages(args, config, num_layers, kv_dtype, device,
                                             state_bytes),
                  args.page_size, config.num_kv_heads, config.head_dim, dtype=kv_dtype,
                  device=device, cache=make_prefix_cache(args, target.model, identity))
    pool.states = states
    drafter: Drafter | MTPDrafter | None = None
    if draft is not None:
        drafter = Drafter(draft.model, pick_backend(args, device, draft.loaded.config, dtype,
                                                    prompt_rows_on_amx(draft.model)),
                          pool.caches[num_attention:], args.page_size)
    elif target.mtp is not None:
        drafter = MTPDrafter(target.mtp, pick_backend(args, device, config, dtype),
                             pool.caches[num_attention], args.page_size)
    stages.done(f"attention kernel ready ({backend.name}; a C kernel is compiled on first use)")
    graphs = None
    if (args.cuda_graph and device.type == "cuda" and backend.can_capture_graphs
            and states is None):  # a hybrid's state slots: not in the captured graphs yet
        graphs = DecodeGraphRunner(target.model, pool, backend, max_batch=args.parallel)
        graphs.capture_all()  # before the scheduler hands out pages: it takes a scratch page
        stages.done(f"CUDA graphs captured for batch buckets {graphs.buckets}")
    return Memory(identity, pool, backend, drafter, graphs)


def checkpoint_pool_slots(args: ServerArgs) -> int:
    """A hybrid's state checkpoints the pool's memory holds (none without a prefix cache)."""
    return args.ctx_checkpoints * args.parallel if args.prefix_cache else 0


def make_state_pool(args: ServerArgs, config: ModelConfig, dtype: torch.dtype,
                    device: torch.device) -> StatePool | None:
    """A hybrid model's state slots: one per --parallel slot, beside the pages."""
    if not config.is_hybrid:
        return None
    draft_rows = args.spec_draft_n_max if args.spec_type != "none" else 0
    states = StatePool(args.parallel, len(config.delta_net_layers), config.delta_net, dtype,
                       device, snapshots=args.prefix_cache, draft_rows=draft_rows)
    log.info("state slots: %d x %.2f MiB (conv + recurrent state of %d DeltaNet layers)%s",
             states.num_slots, states.slot_bytes / MIB, len(config.delta_net_layers),
             ", each with a snapshot at its latest page boundary (prefix cache: checkpoints)"
             if args.prefix_cache else "")
    if checkpoint_pool_slots(args):
        log.info("state checkpoints: %d in the pool's memory (%.2f MiB, --ctx-checkpoints %d "
                 "per slot), more in host RAM inside --preempt-ram", checkpoint_pool_slots(args),
                 checkpoint_pool_slots(args) * states.slot_bytes / MIB, args.ctx_checkpoints)
    if draft_rows:
        log.info("state slots keep the state after each of up to %d draft rows (%.2f MiB): a "
                 "rejected draft's rows are taken back", draft_rows,
                 draft_rows * states.num_slots * states.slot_bytes / MIB)
    return states


def build_engine(args: ServerArgs, target: Target, memory: Memory, budget: Budget,
                 device: torch.device) -> tuple[Engine, Metrics]:
    pool, loaded = memory.pool, target.loaded
    host = HostStore(budget.bytes, pin_memory=device.type == "cuda",
                     fail_allocations=args.preempt_fail_swap)
    # without max_tokens a sequence ends ("length") at the model's context or when it alone
    # fills the whole pool, whichever comes first
    config = scheduler_config_of(args, min(loaded.config.max_position, pool.capacity_tokens),
                                 device)
    log.info("scheduling: %s", "prompts first: decode rows sit out steps for up to "
             f"{config.prefill_first:g} s while more prompt tokens wait than a step takes "
             "(--prefill-first)" if config.prefill_first > 0
             else "every running sequence's decode row in every step (--prefill-first 0)")
    copy = make_copy_engine(pool, args.preempt_async)
    pool.tier = make_host_tier(args, pool, host, copy)
    if pool.states is not None and pool.cache is not None:
        pool.checkpoints = CheckpointStore(host, pool.states.slot_bytes,
                                           checkpoint_pool_slots(args), pool.device)
    swapper = Swapper(pool, host, copy)
    scheduler = Scheduler(config, pool, swapper, loaded.tokenizer.eos_token_ids)
    lock = threading.RLock()  # the engine's: the metrics collector reads state under it
    served = args.served_model_name[0] if args.served_model_name else loaded.name
    metrics = Metrics(scheduler, host, swapper.copy_times, lock, model_name=served)
    slots = SlotMemory(pool, args.parallel)

    def on_finish(seq: Sequence) -> None:
        metrics.on_finish(seq)
        slots.remember(seq)  # the slot's last sequence, for POST /slots/{id}?action=save

    scheduler.on_finish = on_finish
    runner = ModelRunner(target.model, pool, memory.backend, graphs=memory.graphs,
                         fault_token=args.inject_fault_token, drafter=memory.drafter,
                         fault_late=args.inject_fault_late)
    engine = Engine(scheduler, runner, on_step=metrics.on_step, lock=lock, memory=slots,
                    tokenizer=loaded.tokenizer)
    engine.kv_events = make_kv_events(args, pool)
    return engine, metrics


def make_kv_events(args: ServerArgs, pool: KVPool) -> KvEventOutlet | None:
    """--kv-events-config: the prefix cache and its host tier record, a publisher sends."""
    if args.kv_events_config is None:
        return None
    config = kv_events_config(args.kv_events_config)
    if not config.enabled:
        log.info("KV events: off (--kv-events-config enables no zmq publisher)")
        return None
    if pool.cache is None:
        raise ValueError("--kv-events-config reports the prefix cache's pages: it needs the "
                         "prefix cache (leave out --no-prefix-cache)")
    events = KvEventLog(pool.page_size)
    pool.cache.events = events
    if pool.tier is not None:
        pool.tier.events = events
    return KvEventOutlet(events, ZmqEventPublisher(config))


def kv_events_config(text: str) -> KvEventsConfig:
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None


def log_summary(args: ServerArgs, target: Target, memory: Memory, draft: DraftStack | None,
                budget: Budget, config: SchedulerConfig, defaults: GenerationDefaults) -> None:
    loaded, model, pool = target.loaded, target.model, memory.pool
    c = loaded.config
    log.info("model %s (%s): %d layers, %d/%d heads, %s on %s, linears %s%s", loaded.name,
             loaded.source, c.num_layers, c.num_heads, c.num_kv_heads, memory.identity.dtype,
             pool.device, model.weight_format.value,
             ", decode rows from blocks" if model.has_blocks else "")
    log.info("KV pool: %d pages x %d tokens = %d tokens, %s, %.1f MiB; %d slots", pool.num_pages,
             pool.page_size, pool.capacity_tokens, str(pool.dtype).removeprefix("torch."),
             pool.page_bytes * pool.num_pages / 2**20, args.parallel)
    log.info("attention backend %s%s", memory.backend.name,
             f", CUDA graphs for batch buckets {memory.graphs.buckets}" if memory.graphs else "")
    log.info("preemption %s; preempt-ram budget %s; preempt-every %d; watermarks %g%%/%g%%; "
             "resume order %s", "on" if args.preempt else "off (--no-preempt)",
             budget.describe(), args.preempt_every, args.preempt_high, args.preempt_low,
             args.preempt_resume)
    log.info("prefix cache %s", "on" if pool.cache else "off (--no-prefix-cache)")
    log.info("speculative decoding %s", f"{args.spec_type}, drafts of "
             f"{args.spec_draft_n_min}..{args.spec_draft_n_max} tokens"
             + (f" by {draft.loaded.name}" if draft else "") if config.spec.enabled else "off")
    log.info("sampling defaults: %s", defaults.describe())


def prepare_slot_files(args: ServerArgs) -> None:
    """--slot-save-path: the directory made, and temporary files of dead saves removed."""
    if not args.slot_save_path:
        return
    os.makedirs(args.slot_save_path, exist_ok=True)
    stale = remove_stale_temp_files(args.slot_save_path)
    log.info("slot files in %s%s", os.path.realpath(args.slot_save_path),
             f"; removed {len(stale)} temporary files of saves that never finished"
             if stale else "")
