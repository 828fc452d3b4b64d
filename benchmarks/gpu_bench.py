"""GPU benchmarks of the CUDA path; writes gpu_bench.json and gpu_bench.md into --out.

1. decode step time at several batch sizes for synthetic:llama-8b (eager torch backend, eager
   FlashInfer, FlashInfer + CUDA graphs) against the HBM floor: the bytes a step must read
   (weights + the batch's KV) over the device copy bandwidth measured here;
2. attention alone: FlashInfer vs the torch backend, decode and prefill, per layer call;
3. park costs for a ~1000-token sequence: swap park/resume (sync and async engines) and the
   recompute (a prefill of the same tokens);
4. the results table of benchmarks/preemption.py, in process: four concurrent chats of ~1000-token
   prompts through the real Engine and Scheduler on a pool that cannot hold them, per host budget
   (ample / inside the park-size range / 0) and prefix cache (on, the server's default, and off):
   completed, parks by mode (and of them resumed entirely from the cache), the full pages resumes
   took back from the cache, aggregate tokens/s, time parked, and the latency from resume to the
   next token (swap: the copy-in, of only the pages evicted meanwhile when the cache is on;
   recompute: the replay; cached: nothing to copy or replay).
   In process because the GPU machine has no server dependencies (HTTP, tokenizer) and the GGUF
   is too large to travel; the token ids are random, the model synthetic.

`--dry-run` runs every CPU-capable path on synthetic:tiny in seconds (CI-free smoke test of
this script); sections that need CUDA or FlashInfer are recorded as skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _kvpark_path  # noqa: E402

_kvpark_path.ensure_kvpark()

import torch  # noqa: E402

from kvpark.kernels.attention import AttentionBackend, StepLayout  # noqa: E402
from kvpark.kernels.flashinfer_paged import (  # noqa: E402
    AttentionShape,
    FlashInferPagedAttention,
    FlashInferUnavailable,
)
from kvpark.kernels.kv_copy import (  # noqa: E402
    CudaAsyncCopyEngine,
    SyncCopyEngine,
    make_copy_engine,
)
from kvpark.kernels.torch_paged import TorchPagedAttention  # noqa: E402
from kvpark.pod.core.engine import Engine  # noqa: E402
from kvpark.pod.core.messages import Submission  # noqa: E402
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from kvpark.pod.core.sequence import Sequence  # noqa: E402
from kvpark.pod.core.swap import Swapper  # noqa: E402
from kvpark.pod.memory.host_store import HostStore  # noqa: E402
from kvpark.pod.memory.kv_pool import KVPool  # noqa: E402
from kvpark.pod.memory.prefix_cache import PrefixCache  # noqa: E402
from kvpark.pod.model.llama import LlamaModel  # noqa: E402
from kvpark.pod.model.synthetic import synthetic_config, synthetic_weights  # noqa: E402
from kvpark.pod.sampling.sampler import SamplingParams  # noqa: E402
from kvpark.pod.worker.cuda_graphs import DecodeGraphRunner  # noqa: E402
from kvpark.pod.worker.runner import ModelRunner  # noqa: E402

PAGE_SIZE = 16


@dataclass(frozen=True)
class BenchConfig:
    model: str
    device: torch.device
    dtype: torch.dtype
    batches: list[int]
    context: int  # KV tokens each sequence holds when a measured decode step starts
    steps: int
    warmup: int
    park_tokens: int
    prefill_seqs: int
    copy_bytes: int
    chats: ChatsConfig


@dataclass(frozen=True)
class ChatsConfig:
    prompt: int  # tokens of the first chat's prompt; the others are a little longer
    output: int  # generated tokens per chat (ignore_eos: a fixed length)
    pool: int  # tokens the KV pool holds: less than the four chats need together
    runs: int
    timeout_s: float
    caches: tuple[str, ...] = ("on", "off")  # prefix cache modes, run alternately


@dataclass
class Report:
    env: dict = field(default_factory=dict)
    decode: list[dict] = field(default_factory=list)
    attention: list[dict] = field(default_factory=list)
    parks: list[dict] = field(default_factory=list)
    chats: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ---- timing ------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, iters: int,
                   warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s a device-to-device copy moves (each copy reads and writes num_bytes)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, iters=10, warmup=3)
    return 2 * num_bytes / seconds


# ---- model and bytes -----------------------------------------------------------------------------
def build_model(cfg: BenchConfig) -> LlamaModel:
    config = synthetic_config(cfg.model.removeprefix("synthetic:"))
    weights = synthetic_weights(config, device=cfg.device, dtype=cfg.dtype)
    return LlamaModel(config, weights, batch_invariant=False)


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def weight_bytes_per_step(model: LlamaModel, num_rows: int) -> int:
    """Weights a decode step reads: every layer, the final norm, lm_head, `num_rows` embeddings."""
    per_layer = sum(nbytes(getattr(layer, name)) for layer in model.layers for name in (
        "qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight", "input_norm",
        "post_attn_norm", "q_norm", "k_norm"))
    embed_rows = num_rows * model.embed.shape[1] * model.embed.element_size()
    return per_layer + nbytes(model.final_norm) + nbytes(model.lm_head) + embed_rows


def kv_bytes(model: LlamaModel, kv_lens: list[int], dtype: torch.dtype) -> int:
    c = model.config
    element = torch.empty((), dtype=dtype).element_size()
    return sum(kv_lens) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * element


def make_pool(model: LlamaModel, cfg: BenchConfig, num_tokens: int) -> KVPool:
    c = model.config
    num_pages = -(-num_tokens // PAGE_SIZE) + 2
    return KVPool(c.num_layers, num_pages, PAGE_SIZE, c.num_kv_heads, c.head_dim, cfg.dtype,
                  cfg.device)


def attention_shape(model: LlamaModel, dtype: torch.dtype) -> AttentionShape:
    c = model.config
    return AttentionShape(c.num_heads, c.num_kv_heads, c.head_dim, PAGE_SIZE, dtype, dtype)


def make_flashinfer(model: LlamaModel, cfg: BenchConfig) -> FlashInferPagedAttention:
    return FlashInferPagedAttention(cfg.device, attention_shape(model, cfg.dtype))


# ---- 1. decode steps ----------------------------------------------------------------------------
def decode_modes(model: LlamaModel, cfg: BenchConfig, report: Report) -> list[str]:
    modes = ["torch"]
    try:
        make_flashinfer(model, cfg)
        modes += ["flashinfer", "flashinfer+graphs"]
    except FlashInferUnavailable as exc:
        report.skipped.append(f"decode with FlashInfer: {exc}")
    return modes


class DecodeBench:
    """`batch` sequences holding `context` tokens each; every measured step decodes one more."""

    def __init__(self, model: LlamaModel, pool: KVPool, backend: AttentionBackend,
                 graphs: DecodeGraphRunner | None, batch: int, cfg: BenchConfig) -> None:
        self.model, self.pool, self.backend, self.graphs = model, pool, backend, graphs
        room = cfg.context + cfg.steps + cfg.warmup + 1
        self.tables = [pool.allocate(pool.pages_for(room)) for _ in range(batch)]
        self.kv_len = cfg.context

    def step(self) -> list[int]:
        self.kv_len += 1
        batch = len(self.tables)
        layout = StepLayout(self.tables, [self.kv_len] * batch, [1] * batch, PAGE_SIZE)
        ids = [(7 * b + self.kv_len) % 1000 for b in range(batch)]
        positions = [self.kv_len - 1] * batch
        if self.graphs is not None:
            hidden = self.graphs.run(ids, positions, layout)
        else:
            device = self.model.device
            self.backend.plan(layout)
            hidden = self.model(torch.tensor(ids, device=device),
                                torch.tensor(positions, device=device), self.backend,
                                self.pool.caches)
        return self.model.logits(hidden).argmax(-1).cpu().tolist()  # the runner's sync point

    def close(self) -> None:
        for table in self.tables:
            self.pool.free(table)


def bench_decode(model: LlamaModel, cfg: BenchConfig, bandwidth: float, report: Report) -> None:
    max_batch = max(cfg.batches)
    pool = make_pool(model, cfg, max_batch * (cfg.context + cfg.steps + cfg.warmup + 1 + PAGE_SIZE))
    for mode in decode_modes(model, cfg, report):
        backend = TorchPagedAttention(cfg.device) if mode == "torch" else make_flashinfer(model,
                                                                                          cfg)
        graphs = None
        if mode == "flashinfer+graphs":
            started = time.perf_counter()
            graphs = DecodeGraphRunner(model, pool, backend, max_batch)
            graphs.capture_all()
            report.env["graph_capture_s"] = round(time.perf_counter() - started, 2)
        for batch in cfg.batches:
            bench = DecodeBench(model, pool, backend, graphs, batch, cfg)
            seconds = median_seconds(bench.step, cfg.device, cfg.steps, cfg.warmup)
            bench.close()
            report.decode.append(decode_row(model, cfg, mode, batch, seconds, bandwidth))
            print_row("decode", report.decode[-1])
        if graphs is not None:
            graphs.close()


def decode_row(model: LlamaModel, cfg: BenchConfig, mode: str, batch: int, seconds: float,
               bandwidth: float) -> dict:
    kv_len = cfg.context + cfg.warmup + cfg.steps // 2  # the median step's length
    floor_bytes = weight_bytes_per_step(model, batch) + kv_bytes(model, [kv_len] * batch,
                                                                 cfg.dtype)
    floor = floor_bytes / bandwidth
    return {"mode": mode, "batch": batch, "context": cfg.context,
            "step_ms": round(seconds * 1e3, 3), "tok_s": round(batch / seconds, 1),
            "floor_ms": round(floor * 1e3, 3), "floor_bytes": floor_bytes,
            "x_floor": round(seconds / floor, 2)}


# ---- 2. attention alone -------------------------------------------------------------------------
def attention_cases(cfg: BenchConfig) -> list[tuple[str, StepLayout]]:
    cases, page = [], 0
    pages_per_seq = -(-cfg.context // PAGE_SIZE)
    for batch in cfg.batches:
        tables = [list(range(page + b * pages_per_seq, page + (b + 1) * pages_per_seq))
                  for b in range(batch)]
        cases.append(("decode", StepLayout(tables, [cfg.context] * batch, [1] * batch,
                                           PAGE_SIZE)))
    n = cfg.prefill_seqs
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(n)]
    cases.append(("prefill", StepLayout(tables, [cfg.context] * n, [cfg.context] * n,
                                        PAGE_SIZE)))
    return cases


def bench_attention(model: LlamaModel, cfg: BenchConfig, report: Report) -> None:
    c = model.config
    num_pages = max(cfg.batches + [cfg.prefill_seqs]) * -(-cfg.context // PAGE_SIZE)
    cache = torch.randn(num_pages, 2, PAGE_SIZE, c.num_kv_heads, c.head_dim, device=cfg.device,
                        dtype=cfg.dtype)
    backends: dict[str, Callable[[], AttentionBackend]] = {
        "torch": lambda: TorchPagedAttention(cfg.device)}
    try:
        make_flashinfer(model, cfg)
        backends["flashinfer"] = lambda: make_flashinfer(model, cfg)
    except FlashInferUnavailable as exc:
        report.skipped.append(f"attention with FlashInfer: {exc}")
    for op, layout in attention_cases(cfg):
        q = torch.randn(layout.num_tokens, c.num_heads, c.head_dim, device=cfg.device,
                        dtype=cfg.dtype)
        for name, make in backends.items():
            plan_s, attend_s = time_attention(make(), layout, q, cache, cfg.device)
            report.attention.append({"op": op, "batch": layout.num_seqs, "context": cfg.context,
                                     "backend": name, "plan_us": round(plan_s * 1e6, 1),
                                     "attend_us": round(attend_s * 1e6, 1)})
            print_row("attention", report.attention[-1])


def time_attention(backend: AttentionBackend, layout: StepLayout, q: torch.Tensor,
                   cache: torch.Tensor, device: torch.device) -> tuple[float, float]:
    plan_s = median_seconds(lambda: backend.plan(layout), device, 5, 1)
    attend_s = median_seconds(lambda: backend.attend(q, cache), device, 10, 2)
    return plan_s, attend_s


# ---- 3. parks -----------------------------------------------------------------------------------
def bench_parks(model: LlamaModel, cfg: BenchConfig, report: Report) -> None:
    pool = make_pool(model, cfg, 2 * cfg.park_tokens + 2 * PAGE_SIZE)
    pages = pool.allocate(pool.pages_for(cfg.park_tokens))
    host = HostStore(-1, pin_memory=cfg.device.type == "cuda")
    buffer = host.allocate(pool.swap_shape(len(pages)), pool.dtype)
    engines = {"swap-sync": SyncCopyEngine(pool)}
    if cfg.device.type == "cuda":
        engines["swap-async"] = CudaAsyncCopyEngine(pool)
    else:
        report.skipped.append("async swap parks: need CUDA")
    for name, engine in engines.items():
        report.parks.append(park_row(name, engine, pool, pages, buffer, cfg))
        print_row("park", report.parks[-1])
    report.parks.append(recompute_row(model, pool, pages, cfg))
    print_row("park", report.parks[-1])


def park_row(name: str, engine, pool: KVPool, pages: list[int], buffer: torch.Tensor,
             cfg: BenchConfig) -> dict:
    blocking, total = {}, {}
    for kind, start in (("park", engine.start_park), ("resume", engine.start_resume)):
        runs_blocking, runs_total = [], []
        for _ in range(5):
            sync(cfg.device)
            began = time.perf_counter()
            ticket = start(pages, buffer)
            returned = time.perf_counter()
            engine.wait(ticket)
            runs_blocking.append(returned - began)
            runs_total.append(time.perf_counter() - began)
        blocking[kind], total[kind] = statistics.median(runs_blocking), statistics.median(
            runs_total)
    num_bytes = pool.swap_bytes(len(pages))
    return {"mode": name, "tokens": cfg.park_tokens, "bytes": num_bytes,
            "park_ms": round(total["park"] * 1e3, 3), "resume_ms": round(total["resume"] * 1e3, 3),
            "blocking_ms": round(max(blocking.values()) * 1e3, 3),
            "gb_s": round(num_bytes / total["park"] / 1e9, 2)}


def recompute_row(model: LlamaModel, pool: KVPool, pages: list[int], cfg: BenchConfig) -> dict:
    """A recompute park copies nothing; its resume re-runs the prefill of every token."""
    try:
        backend: AttentionBackend = make_flashinfer(model, cfg)
        name = "recompute (flashinfer prefill)"
    except FlashInferUnavailable:
        backend, name = TorchPagedAttention(cfg.device), "recompute (torch prefill)"
    n = cfg.park_tokens
    layout = StepLayout([pages], [n], [n], PAGE_SIZE)
    ids = torch.arange(n, device=cfg.device) % 1000
    positions = torch.arange(n, device=cfg.device)

    def prefill() -> None:
        backend.plan(layout)
        hidden = model(ids, positions, backend, pool.caches)
        model.logits(hidden[-1:]).argmax(-1).cpu()

    seconds = median_seconds(prefill, cfg.device, 3, 1)
    return {"mode": name, "tokens": n, "bytes": 0, "park_ms": 0.0,
            "resume_ms": round(seconds * 1e3, 3), "blocking_ms": round(seconds * 1e3, 3),
            "gb_s": None}


# ---- 4. four chats through the scheduler --------------------------------------------------------
NUM_CHATS = 4


class ChatRecorder:
    """The chats' event stream (what an SSE client sees), timed: resume-to-next-token latency
    by park mode ("cached": a resume that found every full page in the prefix cache), the full
    pages resumes took back from the cache, and a signal when all have finished."""

    def __init__(self, count: int) -> None:
        self.remaining = count
        self.done = threading.Event()
        self.resumed_at: dict[int, tuple[str, float]] = {}
        self.resume_latency: dict[str, list[float]] = {"swap": [], "recompute": [], "cached": []}
        self.pages_from_cache = 0  # full pages resumes found still cached
        self.pages_released = 0  # of the full pages their parks left in the cache

    def on_event(self, seq: Sequence, kind: str) -> None:
        """The scheduler's engine-thread hook (`Scheduler.on_event`)."""
        now = time.perf_counter()
        if kind == "resumed":
            self.resumed_at[seq.seq_id] = (seq.parking.mode.value, now)
            self.pages_from_cache += seq.parking.restored_pages
            self.pages_released += len(seq.parking.cached_pages)
        elif kind == "token" and seq.seq_id in self.resumed_at:
            mode, at = self.resumed_at.pop(seq.seq_id)
            self.resume_latency[mode].append(now - at)
        elif kind == "finished":
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()


def chat_budgets(pool: KVPool, cfg: BenchConfig) -> list[tuple[str, int]]:
    one_park = pool.swap_bytes(pool.pages_for(cfg.chats.prompt))
    # room for one ~prompt-sized park, not two: some parks swap, the rest recompute
    return [("ample", -1), ("inside park range", one_park * 3 // 2), ("0", 0)]


def chat_sequences(cfg: BenchConfig, vocab: int) -> list[Sequence]:
    seqs = []
    for i in range(NUM_CHATS):
        gen = torch.Generator().manual_seed(i)
        prompt = torch.randint(0, vocab, (cfg.chats.prompt + 16 * i,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=cfg.chats.output, ignore_eos=True)
        seqs.append(Sequence(Submission(f"chat{i}", tuple(prompt), params, None,
                                        lambda event: None), torch.Generator()))
    return seqs


def run_chats(model: LlamaModel, runner: ModelRunner, cfg: BenchConfig, pool: KVPool,
              budget: int) -> tuple[list[Sequence], Scheduler, ChatRecorder, float]:
    host = HostStore(budget, pin_memory=cfg.device.type == "cuda")
    config = SchedulerConfig(num_slots=NUM_CHATS, max_context=pool.capacity_tokens)
    scheduler = Scheduler(config, pool, Swapper(pool, host, make_copy_engine(pool)))
    engine = Engine(scheduler, runner)
    recorder = ChatRecorder(NUM_CHATS)
    scheduler.on_event = recorder.on_event
    seqs = chat_sequences(cfg, model.config.vocab_size)
    engine.start()
    started = time.perf_counter()
    # the harness keeps its sequences to read them after (the HTTP side submits values)
    engine.call_soon(lambda: [scheduler.add(seq) for seq in seqs])
    finished = recorder.done.wait(cfg.chats.timeout_s)
    wall = time.perf_counter() - started
    engine.stop()
    if not finished:
        raise TimeoutError(f"chats unfinished after {cfg.chats.timeout_s:.0f} s")
    return seqs, scheduler, recorder, wall


def ms(values: list[float], pick: Callable[[list[float]], float]) -> float | None:
    return round(pick(values) * 1e3, 2) if values else None


def use_prefix_cache(pool: KVPool, on: bool) -> None:
    """A fresh prefix cache on the pool (or none): a run must not find the previous run's
    prompts. Call between runs, when only cached pages are left: they are evicted to the free
    list first."""
    if pool.cache is not None:
        pool.free(pool.allocate(pool.num_free_pages))
    pool.cache = PrefixCache("gpu_bench", PAGE_SIZE) if on else None


def chats_row(label: str, budget: int, seqs: list[Sequence], scheduler: Scheduler,
              recorder: ChatRecorder, wall: float, cfg: BenchConfig) -> dict:
    stats = scheduler.stats
    parked = [s.parking.seconds for s in seqs]
    return {
        "budget": label, "budget_mib": "unbounded" if budget < 0 else round(budget / 2**20, 3),
        "prefix_cache": "off" if scheduler.pool.cache is None else "on",
        "completed": f"{sum(s.num_generated == cfg.chats.output for s in seqs)}/{len(seqs)}",
        "swap": stats.n_preempt_swap, "recompute": stats.n_preempt_recompute,
        "cached": stats.n_preempt_cached,
        "pages_from_cache": f"{recorder.pages_from_cache}/{recorder.pages_released}",
        "recomputed_tokens": stats.n_recompute_tokens,
        "agg_tok_s": round(sum(s.num_generated for s in seqs) / wall, 1),
        "wall_s": round(wall, 2),
        "parked_s_max": round(max(parked), 3), "parked_s_sum": round(sum(parked), 3),
        "swap_out_ms": ms(scheduler.swapper.copy_times.park, statistics.median),
        "swap_in_ms": ms(scheduler.swapper.copy_times.resume, statistics.median),
        "resume_to_token_ms_swap": ms(recorder.resume_latency["swap"], statistics.median),
        "resume_to_token_ms_recompute": ms(recorder.resume_latency["recompute"],
                                           statistics.median),
        "resume_to_token_ms_cached": ms(recorder.resume_latency["cached"], statistics.median),
    }


def chat_backend(model: LlamaModel, cfg: BenchConfig) -> AttentionBackend:
    try:
        return make_flashinfer(model, cfg)
    except FlashInferUnavailable:
        return TorchPagedAttention(cfg.device)


def bench_chats(model: LlamaModel, cfg: BenchConfig, report: Report,
                save: Callable[[], None] = lambda: None) -> None:
    """As the server runs on CUDA: FlashInfer, decode graphs, asynchronous swap copies, the
    prefix cache on (and off, to compare). `save` after each row: a run cut short keeps them."""
    c = model.config
    pool = KVPool(c.num_layers, cfg.chats.pool // PAGE_SIZE, PAGE_SIZE, c.num_kv_heads,
                  c.head_dim, cfg.dtype, cfg.device)
    backend = chat_backend(model, cfg)
    graphs = None
    if cfg.device.type == "cuda" and hasattr(backend, "plan_graph"):
        graphs = DecodeGraphRunner(model, pool, backend, max_batch=NUM_CHATS)
        graphs.capture_all()  # takes a scratch page, as in the server
    runner = ModelRunner(model, pool, backend, graphs=graphs)
    free_pages = pool.num_free_pages
    report.env["chats"] = {**asdict(cfg.chats), "backend": backend.name,
                           "cuda_graphs": graphs is not None,
                           "copy_engine": type(make_copy_engine(pool)).__name__}
    for label, budget in chat_budgets(pool, cfg):
        rows: dict[str, list[dict]] = {cache: [] for cache in cfg.chats.caches}
        for _ in range(cfg.chats.runs):
            for cache in cfg.chats.caches:  # alternating, so the modes share the machine
                use_prefix_cache(pool, cache == "on")
                seqs, scheduler, recorder, wall = run_chats(model, runner, cfg, pool, budget)
                assert pool.num_free_pages == free_pages, "pages leaked"
                rows[cache].append(chats_row(label, budget, seqs, scheduler, recorder, wall,
                                             cfg))
        for runs in rows.values():
            row = min(runs, key=lambda r: r["wall_s"])  # the least disturbed run
            row["runs_tok_s"] = [r["agg_tok_s"] for r in runs]
            report.chats.append(row)
            print_row("chats", row)
            save()
    use_prefix_cache(pool, False)
    if graphs is not None:
        graphs.close()

# ---- output -------------------------------------------------------------------------------------
def print_row(section: str, row: dict) -> None:
    print(f"[{section}] " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "_(none)_\n"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_report(report: Report, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(asdict(report), indent=2, default=str))
    parts = ["# GPU benchmark\n", "```\n" + json.dumps(report.env, indent=1, default=str)
             + "\n```\n", "## Decode step vs HBM floor\n", markdown_table(report.decode),
             "## Attention per layer call\n", markdown_table(report.attention),
             "## Park costs\n", markdown_table(report.parks),
             "## Four concurrent chats on a pool too small for all\n", markdown_table(report.chats)]
    if report.skipped:
        parts += ["## Skipped\n", "".join(f"- {s}\n" for s in report.skipped)]
    if report.errors:
        parts += ["## Errors\n", "".join(f"- {e}\n" for e in report.errors)]
    (out / "gpu_bench.md").write_text("\n".join(parts))
    print(f"wrote {out / 'gpu_bench.json'} and {out / 'gpu_bench.md'}", flush=True)


def environment(cfg: BenchConfig) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "model": cfg.model, "dtype": str(cfg.dtype),
           "device": str(cfg.device), "page_size": PAGE_SIZE}
    if cfg.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(cfg.device)
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError as exc:
        env["flashinfer"] = f"unavailable: {exc}"
    env["FLASHINFER_DISABLE_JIT"] = os.environ.get("FLASHINFER_DISABLE_JIT")
    return env


def run_section(name: str, fn: Callable[[], None], report: Report) -> None:
    """One failing section must not cost the others: a GPU run is one shot."""
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # recorded in the report, then the next section runs
        traceback.print_exc()
        report.errors.append(f"{name}: {type(exc).__name__}: {exc}")
    report.env[f"{name}_s"] = round(time.perf_counter() - started, 1)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--dry-run", action="store_true", help="CPU, synthetic:tiny, tiny sizes")
    p.add_argument("--model", default="synthetic:llama-8b")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--chat-output", type=int, default=256, help="tokens each chat generates")
    p.add_argument("--chat-cache", default="on,off",
                   help="prefix cache modes of the chats, comma-separated (on, off)")
    args = p.parse_args(argv)
    caches = tuple(args.chat_cache.split(","))
    if not set(caches) <= {"on", "off"}:
        p.error(f"--chat-cache takes on, off or both, got {args.chat_cache!r}")
    if args.dry_run:
        cfg = BenchConfig("synthetic:tiny", torch.device("cpu"), torch.float32, [1, 2], 40, 2, 1,
                          park_tokens=100, prefill_seqs=2, copy_bytes=16 << 20,
                          chats=ChatsConfig(prompt=60, output=24, pool=240, runs=1,
                                            timeout_s=120, caches=caches))
    else:
        assert torch.cuda.is_available(), "the GPU benchmark needs CUDA (or use --dry-run)"
        cfg = BenchConfig(args.model, torch.device("cuda"), torch.bfloat16,
                          [int(b) for b in args.batches.split(",")], args.context, args.steps,
                          warmup=3, park_tokens=1000, prefill_seqs=4, copy_bytes=2 << 30,
                          chats=ChatsConfig(prompt=1000, output=args.chat_output, pool=3072,
                                            runs=2, timeout_s=60, caches=caches))
    return cfg, Path(args.out)


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    torch.manual_seed(0)
    report = Report(env=environment(cfg))
    bandwidth = measure_copy_bandwidth(cfg.device, cfg.copy_bytes)
    report.env["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    started = time.perf_counter()
    model = build_model(cfg)
    report.env["model_build_s"] = round(time.perf_counter() - started, 1)
    report.env["weight_bytes_per_step_b1"] = weight_bytes_per_step(model, 1)

    def save() -> None:  # after every section: a run cut short by its time limit keeps these
        write_report(report, out)

    run_section("decode", lambda: bench_decode(model, cfg, bandwidth, report), report)
    save()
    run_section("attention", lambda: bench_attention(model, cfg, report), report)
    save()
    run_section("parks", lambda: bench_parks(model, cfg, report), report)
    save()
    run_section("chats", lambda: bench_chats(model, cfg, report, save), report)
    save()
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
