"""Where a CPU decode step's time goes: scheduler, runner, model parts, Python, lm_head, sampling.

    python benchmarks/profile_step.py --batch 1 4 --context 1000 --threads 1
    python benchmarks/profile_step.py --variant fp32 bf16 fp32@2 --batch 4 --threads 1  # A/B

`batch` sequences of `context` random prompt tokens are prefilled through the real scheduler and
runner (so page tables fragment the way they do when serving), then decode steps are timed with
clocks around each stage and around every linear, attention call and KV append inside the
forward; the rest of the forward is norms, RoPE, residual adds and the Python between ops. The
clocks read process CPU time, which other people's jobs on a shared machine inflate less than
wall time (the step's wall time is shown too). The torch profiler counts the aten ops a step
calls, and a one-op loop measures what one op costs when it does almost nothing: their product
is the step's dispatch floor. Variants are measured in alternating rounds in the same process,
so their ratio holds on a machine others are using.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import kvpark.pod.model.decoder_base as decoder_base_module
import kvpark.pod.model.layers as layers_module
import kvpark.pod.worker.runner as runner_module
from kvpark.kernels import cpu_paged, worker_pool
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.kernels.layer_ops import FusedLayer, FusedStack
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.core.messages import Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Sequence
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.model.linear import WeightFormat
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.loader import LoadedModel, load_model_files
from kvpark.pod.sampling.sampler import SamplingParams, make_generator
from kvpark.pod.worker.runner import ModelRunner

PAGE_SIZE = 16
STAGES = ("scheduler", "runner", "forward", "lm_head", "sampling", "postprocess")
PARTS = ("matmul", "fused", "stack", "attention", "kv_append")  # timed inside the forward


def now() -> float:
    """CPU seconds of this process: unlike wall time, not inflated while the scheduler runs
    someone else's tests (memory-bandwidth and cache contention still show)."""
    return time.process_time()


@dataclass(frozen=True)
class Variant:
    """One measured configuration, `WEIGHTS[,KV][@THREADS[/KERNEL_THREADS]][+BACKEND]`: `fp32`,
    `bf16`, `gguf`, `fp32,float16@2`, `fp32+torch`, `gguf@1/2` (1 torch, 2 C kernel threads).

    WEIGHTS is a `WeightFormat` or `gguf` (float32, decode rows from the GGUF's blocks: the
    server's default without AMX) or `gguf:FORMAT` (the blocks beside FORMAT's dense linears:
    `gguf:amx-bf16` is the default where AMX runs); KV the pool's dtype (float32 unless
    given); BACKEND the attention backend, `cpu` (the C kernel) or `torch`, by default what
    the server picks.
    """

    name: str
    weight_format: WeightFormat
    kv_dtype: torch.dtype
    threads: int
    backend: str
    blocks: bool = False
    kernel_threads: int = 1

    @classmethod
    def parse(cls, spec: str, default_threads: int) -> Variant:
        rest, _, backend = spec.partition("+")
        formats, _, all_threads = rest.partition("@")
        threads, _, kernel_threads = all_threads.partition("/")
        weights, _, kv = formats.partition(",")
        kv_dtype = getattr(torch, kv or "float32")
        if not backend:
            usable = kv_dtype == torch.float32 and cpu_paged.is_available()
            backend = "cpu" if usable else "torch"
        source, _, dense = weights.partition(":")  # gguf:amx-bf16 = blocks beside AMX GEMMs
        blocks = source == "gguf"
        return cls(spec, WeightFormat(dense or "fp32" if blocks else weights), kv_dtype,
                   int(threads) if threads else default_threads, backend, blocks,
                   int(kernel_threads or 1))

    def make(self, loaded: LoadedModel) -> tuple[LlamaModel, AttentionBackend]:
        model = LlamaModel(loaded.config, loaded.weights, batch_invariant=True,
                           weight_format=self.weight_format,
                           quantized=loaded.quantized if self.blocks else None)
        backend = CpuPagedAttention() if self.backend == "cpu" else TorchPagedAttention()
        return model, backend


# ---- timing hooks -------------------------------------------------------------------------------
@dataclass
class StepClock:
    """Wall seconds per stage of the current step, filled by wrappers around each stage."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    enabled: bool = True

    def wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            started = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[stage] += now() - started
        return timed


CLOCK = StepClock()  # the model's module-level functions report here, whichever setup runs


@dataclass
class Setup:
    """One variant's model, pool, scheduler and runner with `batch` sequences in decode."""

    variant: Variant
    model: LlamaModel
    scheduler: Scheduler
    runner: ModelRunner

    def step(self) -> None:
        """schedule -> run -> advance, as the engine does (stop checks aside)."""
        plan = CLOCK.wrap("scheduler", self.scheduler.schedule)()
        sampled = CLOCK.wrap("runner", self.runner.run)(plan)
        started = now()
        for item, out in zip(plan, sampled):
            self.scheduler.advance(item, None if out.sampled is None else out.sampled.token,
                                   item.seq.num_complete)
        CLOCK.seconds["postprocess"] += now() - started


def build_setup(variant: Variant, loaded: LoadedModel, batch: int, context: int,
                max_new: int, seed: int) -> Setup:
    torch.set_num_threads(variant.threads)
    model, backend = variant.make(loaded)
    config = model.config
    # twice what the batch needs, so the scheduler never parks anything
    num_pages = 2 * batch * -(-(context + max_new + 1) // PAGE_SIZE)
    pool = KVPool(config.num_layers, num_pages, PAGE_SIZE, config.num_kv_heads, config.head_dim,
                  dtype=variant.kv_dtype)
    scheduler = Scheduler(SchedulerConfig(num_slots=batch), pool, Swapper(pool, HostStore(-1)))
    runner = ModelRunner(model, pool, backend)
    model.forward = CLOCK.wrap("forward", model.forward)
    model.logits = CLOCK.wrap("lm_head", without_matmul(model.logits))
    backend.attend = CLOCK.wrap("attention", backend.attend)
    backend.append_kv = CLOCK.wrap("kv_append", backend.append_kv)
    gen = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(100, config.vocab_size, (context,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, ignore_eos=True)
        scheduler.add(Sequence(Submission(f"bench-{i}", tuple(prompt), params, 0,
                                          lambda seq, kind, token: None), make_generator(0)))
    setup = Setup(variant, model, scheduler, runner)
    while any(seq.num_pending > 1 for seq in scheduler.active) or scheduler.waiting:
        setup.step()  # prefill (chunked, as when serving)
    assert all(seq.parking.n_preempt == 0 for seq in scheduler.active), "the pool is too small"
    return setup


def without_matmul(fn: Callable) -> Callable:
    """`fn`'s linears are not the forward's: keep them out of the "matmul" stage."""
    def wrapper(*args, **kwargs):
        before = CLOCK.seconds.get("matmul", 0.0)
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.seconds["matmul"] = before
    return wrapper


def patch_globals() -> None:
    """Time every linear and sampling: both are module globals looked up at each call."""
    for module in (layers_module, decoder_base_module):  # the layers' and lm_head's linears
        module.linear = CLOCK.wrap("matmul", module.linear)
    layers_module.linear_silu = CLOCK.wrap("matmul", layers_module.linear_silu)  # + SwiGLU
    layers_module.linear_add = CLOCK.wrap("matmul", layers_module.linear_add)  # + residual
    for half in ("attention_inputs", "mlp_residual"):  # linears, norms, RoPE, silu, adds in C
        setattr(FusedLayer, half, CLOCK.wrap("fused", getattr(FusedLayer, half)))
    # a decode step whose rows all read blocks: every layer (attention too) in one C call
    FusedStack.decode = CLOCK.wrap("stack", FusedStack.decode)
    runner_module.sample = CLOCK.wrap("sampling", runner_module.sample)


# ---- measuring ----------------------------------------------------------------------------------
def measure_wall(setups: list[Setup], steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median ms per stage per variant; variants take turns every `steps` steps."""
    per_step: dict[str, list[dict[str, float]]] = defaultdict(list)
    for _ in range(rounds):
        for setup in setups:
            torch.set_num_threads(setup.variant.threads)
            worker_pool.set_num_threads(setup.variant.kernel_threads)
            for _ in range(steps):
                CLOCK.seconds.clear()
                started, cpu_started = time.perf_counter(), now()
                setup.step()
                row = {stage: seconds * 1e3 for stage, seconds in CLOCK.seconds.items()}
                row["step"] = (now() - cpu_started) * 1e3
                row["wall"] = (time.perf_counter() - started) * 1e3
                per_step[setup.variant.name].append(with_remainders(row))
    return {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
            for name, rows in per_step.items()}


def with_remainders(row: dict[str, float]) -> dict[str, float]:
    """The step's stages plus what the timers leave over, per step (so medians stay apart)."""
    row = {key: row.get(key, 0.0) for key in ("wall", "step", *STAGES, *PARTS)}
    row["rest"] = row["forward"] - sum(row[p] for p in PARTS)
    row["runner rest"] = row["runner"] - row["forward"] - row["lm_head"] - row["sampling"]
    return row


def count_ops(setup: Setup, steps: int) -> float:
    """aten ops a decode step calls from Python (nested ops not counted)."""
    torch.set_num_threads(setup.variant.threads)
    CLOCK.enabled = False
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            setup.step()
    CLOCK.enabled = True
    top = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    return len(top) / steps


def seconds_per_op(iters: int = 20000) -> float:
    """What one aten op costs when its kernel does almost nothing (dispatch + Python call)."""
    x = torch.ones(576)
    with torch.inference_mode():
        for _ in range(1000):
            x.mul(1.0)
        started = time.perf_counter()
        for _ in range(iters):
            x.mul(1.0)
    return (time.perf_counter() - started) / iters


def breakdown(wall: dict[str, float], num_ops: float, op_ms: float,
              num_layers: int) -> dict[str, float]:
    rest = wall["rest"]
    return {
        "step, wall": wall["wall"],
        "step, CPU time": wall["step"],
        "scheduler": wall["scheduler"],
        "runner: tensors, plan": wall["runner rest"],
        "forward": wall["forward"],
        "  linears": wall["matmul"],
        "  all layers in one C call (block rows)": wall["stack"],
        "  fused C layer halves (block rows)": wall["fused"],
        "  attention": wall["attention"],
        "  KV append": wall["kv_append"],
        "  norms, RoPE, adds, Python": rest,
        "  ... per layer": rest / num_layers,
        "lm_head": wall["lm_head"],
        "sampling": wall["sampling"],
        "postprocess": wall["postprocess"],
        "aten ops per step": num_ops,
        "dispatch floor (ops x op cost)": num_ops * op_ms,
    }


def print_breakdowns(tables: dict[str, dict[str, float]]) -> None:
    names = list(tables)
    keys = list(next(iter(tables.values())))
    width = max(len(k) for k in keys) + 2
    print("".ljust(width) + "".join(n.rjust(14) for n in names))
    for key in keys:
        cell = "{:.0f}" if key == "aten ops per step" else "{:.2f} ms"
        print(key.ljust(width) + "".join(cell.format(tables[n][key]).rjust(14) for n in names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--variant", nargs="+", default=["fp32"],
                   help="WEIGHTS[,KV][@THREADS[/KERNEL_THREADS]]: weights fp32, bf16 or gguf, KV "
                   "pool dtype (float32, float16, bfloat16), torch threads (default --threads), "
                   "C kernel threads (1)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--context", type=int, default=1000, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--threads", type=int, required=True, help="torch threads (explicit)")
    p.add_argument("--out", default="benchmarks/results/profile_step.json")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    variants = [Variant.parse(spec, args.threads) for spec in args.variant]
    loaded = load_model_files(args.model)
    patch_globals()
    results: dict[str, dict] = {}
    max_new = args.rounds * args.steps + args.profile_steps + 2
    for batch in args.batch:
        setups = [build_setup(v, loaded, batch, args.context, max_new, seed=batch)
                  for v in variants]
        wall = measure_wall(setups, args.steps, args.rounds)
        op_ms = seconds_per_op() * 1e3
        tables = {}
        for setup in setups:
            num_ops = count_ops(setup, args.profile_steps)
            tables[setup.variant.name] = breakdown(wall[setup.variant.name], num_ops, op_ms,
                                                   setup.model.config.num_layers)
        print(f"\n{args.model}: batch {batch}, context {args.context}, threads {args.threads}, "
              f"median of {args.rounds} x {args.steps} decode steps; one op {op_ms * 1e3:.1f} us")
        print_breakdowns(tables)
        for name, table in tables.items():
            print(f"{name}: {batch * 1e3 / table['step, wall']:.1f} tok/s decode (wall), "
                  f"{batch * 1e3 / table['step, CPU time']:.1f} per CPU second")
        results[f"batch{batch}"] = tables
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
