"""Choices measured on this machine at start: whether decode rows read blocks
(`--weights auto`), how many C kernel threads (`--kernel-threads 0`) and torch threads
(`--threads 0`) to run, each from a few timed rounds within a small budget, with the machine's
load logged so a slow server's log says why it chose what it chose.

A busy machine cannot be measured (a second thread waits for a core and looks useless), and
these choices hold for the server's life: a thread count and the decode weights are part of a
step's arithmetic, and a replay must compute what the first pass computed. So a measurement may
only lower a count, or drop the blocks, when it was taken on a quiet machine; on a busy one the
defaults stay: every core the process may use (affinity and CPU quota) and the blocks. A pod
started beside others then runs as an idle start would have chosen, or near it, not at one
thread for life.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpark.kernels import worker_pool
from kvpark.kernels.cores import usable_cores

from ..args import MAX_TORCH_THREADS, ServerArgs
from ..model.layers import DecoderLayer
from ..model.linear import MIN_INVARIANT_ROWS, gemm_engine, pad_rows
from ..model.llama import LlamaModel

log = logging.getLogger("kvpark.autotune")


AUTO_ROUNDS = 8
AUTO_BUDGET_S = 0.6  # the start-up measurement stops after this much time
# decode rows weigh the full batch too where -np makes one of at least this many rows (below,
# one row's time decides: the block kernel's lead there is what matters), at most this many
FULL_BATCH_MIN_ROWS = 8
FULL_BATCH_MAX_ROWS = 64
FULL_BATCH_MARGIN = 0.8  # the dense GEMM takes decode rows only where it costs 20% less
FULL_BATCH_BUSY = ("; the kernels were compared in alternating rounds on the same threads, "
                   "which a busy machine slows alike")
BUSY_SPREAD = 0.15  # a variant's median round this much slower than its best: others ran too
SPARE_CORE = 0.25  # others left less than our cores idle, by this much: they took a core from us
KEPT_WHEN_BUSY = ("; so the defaults stay, every core and the blocks: a measurement may lower "
                  "them only on a quiet machine, and the choice holds for the server's life")


@dataclass(frozen=True)
class Conditions:
    """What the machine was like while a start-up measurement ran: a loaded machine measures
    thread counts wrong (a second thread waits for a core), and the log must say so."""

    load_average: float  # the 1-minute load average as the measurement ended (it lags)
    cores: int
    spread: float  # the largest median/best - 1 of any variant's rounds
    rounds: int
    # cores other processes kept busy while it ran, on a machine of `machine_cores` (None: no
    # /proc/stat to read)
    others: float | None = None
    machine_cores: int = 0

    @property
    def busy(self) -> bool:
        return (self.load_average >= self.cores or self.spread > BUSY_SPREAD
                or self.others_took_a_core)

    @property
    def others_took_a_core(self) -> bool:
        return self.others is not None and (
            self.others > self.machine_cores - self.cores + SPARE_CORE)

    def describe(self) -> str:
        text = (f"{self.rounds} round{'s' * (self.rounds > 1)}, median {self.spread:.0%} over "
                f"the best; load average {self.load_average:.2f} on {self.cores} cores")
        if self.others is not None:
            text += (f"; other processes kept {self.others:.2f} of the machine's "
                     f"{self.machine_cores} cores busy")
        if self.busy:
            text += "; the machine was busy while measuring"
        return text


@dataclass(frozen=True)
class CpuSample:
    """Busy CPU seconds of the whole machine (None without /proc/stat) and of this process."""

    at: float
    machine: float | None
    own: float

    @classmethod
    def now(cls) -> CpuSample:
        times = os.times()  # its elapsed: wall time, apart from the clock the rounds read
        return cls(times.elapsed, machine_busy_seconds(), times.user + times.system)


def machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is in user


def other_cores(before: CpuSample, after: CpuSample) -> float | None:
    """Cores other processes kept busy on average between two samples."""
    wall = after.at - before.at
    if before.machine is None or after.machine is None or wall <= 0:
        return None
    return max(0.0, (after.machine - before.machine) - (after.own - before.own)) / wall


@dataclass(frozen=True)
class Rounds:
    times: dict[int, list[float]]  # seconds of each timed round, by variant
    others: float | None = None  # cores other processes kept busy meanwhile

    @property
    def best(self) -> dict[int, float]:
        return {variant: min(times) for variant, times in self.times.items()}

    def conditions(self) -> Conditions:
        spread = max((statistics.median(t) / min(t) - 1 for t in self.times.values() if min(t)),
                     default=0.0)
        return Conditions(os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
                          usable_cores().count, spread,
                          min(len(t) for t in self.times.values()), self.others,
                          os.cpu_count() or 1)


def timed_rounds(run: Callable[[int], float], variants: list[int]) -> Rounds:
    """`run(variant)` once each to warm up, then in alternating rounds (so that a change in the
    machine's load hits every variant alike) until AUTO_ROUNDS or AUTO_BUDGET_S."""
    for variant in variants:  # first touches: caches, the pools' workers
        run(variant)
    times: dict[int, list[float]] = {variant: [] for variant in variants}
    deadline = time.perf_counter() + AUTO_BUDGET_S
    before = CpuSample.now()
    for _ in range(AUTO_ROUNDS):
        for variant in variants:
            times[variant].append(run(variant))
        if time.perf_counter() > deadline:
            break
    return Rounds(times, other_cores(before, CpuSample.now()))


@dataclass(frozen=True)
class DecodeTimings:
    """Seconds for one decode row through every layer's MLP linears (most of a step's bytes):
    from blocks by kernel thread count, and float32 oneDNN."""

    blocks: dict[int, float]
    dense: float
    conditions: Conditions

    @property
    def best_threads(self) -> int:
        """More threads only where they save 5%: a second thread costs CPU time."""
        fewest = min(self.blocks)
        faster = [n for n, t in self.blocks.items() if t < 0.95 * self.blocks[fewest]]
        return min(faster, key=self.blocks.__getitem__, default=fewest)


def mlps_with_blocks(model: LlamaModel) -> list[DecoderLayer]:
    """The layers whose MLP linears both have blocks: what the decode measurements run."""
    return [layer for layer in model.layers
            if layer.gate_up.blocks is not None and layer.down.blocks is not None]


def measure_decode_linears(model: LlamaModel, thread_counts: list[int]) -> DecodeTimings:
    """The block kernel at each thread count vs the dense GEMM on this machine, in alternating
    rounds (best of each): all layers' MLP weights outgrow the caches, as a decode step does."""
    layers = mlps_with_blocks(model)
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


@dataclass(frozen=True)
class FullBatchTimings:
    """Seconds for `rows` decode rows at once (the batch -np slots make) through every layer's
    MLP linears: from blocks, and dense (the prompt rows' GEMM, AMX tiles where they run)."""

    rows: int
    blocks: float
    dense: float
    conditions: Conditions


def measure_full_batch(model: LlamaModel, rows: int) -> FullBatchTimings:
    layers = mlps_with_blocks(model)
    x = torch.randn(rows, model.config.hidden_size)
    mid = torch.randn(rows, model.config.intermediate_size)

    def run(blocks: int) -> float:
        start = time.perf_counter()
        for layer in layers:
            if blocks:
                layer.gate_up.from_blocks(x), layer.down.from_blocks(mid)
            else:
                layer.gate_up.dense(x), layer.down.dense(mid)
        return time.perf_counter() - start

    with torch.inference_mode():
        rounds = timed_rounds(run, [1, 0])
    return FullBatchTimings(rows, rounds.best[1], rounds.best[0], rounds.conditions())


def choose_decode_weights(args: ServerArgs, model: LlamaModel) -> None:
    """By measurement on this machine: `--weights auto` keeps decode rows on blocks (the
    GGUF's, or Q8_0 made at load) only where they cost less than the dense GEMM: one row, plus,
    where -np makes a batch of FULL_BATCH_MIN_ROWS or more, that batch (a dense GEMM on AMX
    tiles costs little more for 32 rows than for 1, the block kernel's cost grows with the
    rows; a lone row reads twice the bytes from bf16 weights, so both loads weigh in). The
    choice holds for the server's life, so a row's kernels stay a property of the row.
    `--kernel-threads 0` takes more threads only where they are faster."""
    auto_threads = args.kernel_threads == 0
    if not model.has_blocks or (args.weights != "auto" and not auto_threads):
        return
    counts = [1, worker_pool.get_num_threads()] if auto_threads else [args.kernel_threads]
    timings = measure_decode_linears(model, counts)
    busy = timings.conditions.busy
    if auto_threads:
        worker_pool.set_num_threads(max(counts) if busy else timings.best_threads)
    blocks, dense = timings.blocks[worker_pool.get_num_threads()], timings.dense
    full = None
    if args.weights == "auto" and args.parallel >= FULL_BATCH_MIN_ROWS:
        full = measure_full_batch(model, min(args.parallel, FULL_BATCH_MAX_ROWS))
    if full is None:
        keep = args.weights != "auto" or busy or blocks <= dense
    else:
        # both kernels run on the same worker threads in alternating rounds, so a busy machine
        # slows them alike (unlike thread counts, which it fools): the margin is what guards
        busy = False
        keep = dense + full.dense > FULL_BATCH_MARGIN * (blocks + full.blocks)
    engine = f"{model.weight_format.value} {gemm_engine(model.weight_format, model.device)}"
    batch = ("" if full is None else f"; {full.rows} rows (-np): blocks {full.blocks * 1e3:.2f} "
             f"ms, {engine} {full.dense * 1e3:.2f} ms")
    log.info("--weights %s, --kernel-threads %s: decode rows from %s, kernel threads %d (one row "
             "through every layer's MLP: blocks %s, %s %.2f ms%s; %s%s)",
             args.weights, "auto" if auto_threads else args.kernel_threads,
             "blocks" if keep else f"{engine} (faster here)",
             worker_pool.get_num_threads(),
             ", ".join(f"{t * 1e3:.2f} ms at {n} thread{'s' * (n > 1)}"
                       for n, t in timings.blocks.items()), engine, timings.dense * 1e3, batch,
             (full.conditions if full else timings.conditions).describe(),
             KEPT_WHEN_BUSY if busy else FULL_BATCH_BUSY if full and full.conditions.busy
             else "")
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
    take them) at each torch thread count, alternating rounds, best of each. Where the GEMMs run
    in the AMX tile kernel (its own threads), the whole MLP with its norm and residuals: what
    torch's threads still compute, beside the kernel's."""
    layers = model.layers[:PROMPT_PROBE_LAYERS]
    x = torch.randn(PROMPT_PROBE_ROWS, model.config.hidden_size)
    mid = torch.randn(PROMPT_PROBE_ROWS, model.config.intermediate_size)
    amx = gemm_engine(model.weight_format, model.device) == "amx"
    attn = torch.randn(PROMPT_PROBE_ROWS, layers[0].o.in_features) if layers else x

    def run(threads: int) -> float:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        for layer in layers:
            if amx:  # a hybrid's layers keep theirs in an MLPBlock
                layer.mlp(x) if hasattr(layer, "mlp") else layer.mlp_residual(x, attn, None)
            else:
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
    `pick_threads` says why. Where the GEMMs run in the AMX tile kernel, torch's threads only
    compute norms and activations beside the kernel's threads, and compete with them for the
    cores (a 330-token prompt took 380 ms with 2 torch threads, 300 with 1, on 2 cores): one
    torch thread unless a quiet measurement finds more 30% faster."""
    cores = min(usable_cores().count, MAX_TORCH_THREADS)
    # a hybrid's decode rows run every linear in torch (no blocks): its GEMMs are the step
    torch_decodes = getattr(model.config, "is_hybrid", False)
    if (args.threads != 0 or not (model.has_blocks or torch_decodes)
            or model.device.type != "cpu" or cores < 2):
        return
    amx = gemm_engine(model.weight_format, model.device) == "amx"
    timings = measure_prompt_gemms(model, [1, cores])
    one, every = timings.by_threads[1], timings.by_threads[cores]
    busy = timings.conditions.busy
    faster = every * PROMPT_THREADS_GAIN < one
    chosen = cores if (faster and not busy) or (busy and not amx) else 1
    torch.set_num_threads(chosen)
    what = ("the MLPs beside the AMX tile kernel's threads" if amx
            else "prompt GEMMs")
    kept = ("; one stays: the GEMMs run in the tile kernel's threads" if busy and amx
            else KEPT_WHEN_BUSY if busy else "")
    log.info("--threads auto: %d torch thread%s for %s (a %d-row chunk through %d "
             "layers' MLPs: %.2f ms at 1 thread, %.2f ms at %d; %s%s)", chosen,
             "s" * (chosen > 1), what, PROMPT_PROBE_ROWS, PROMPT_PROBE_LAYERS, one * 1e3,
             every * 1e3, cores, timings.conditions.describe(), kept)


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
