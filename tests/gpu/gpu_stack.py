"""The server's CUDA stack without HTTP, for the GPU tests (a plain module: `conftest` names
clash across folders): pool (with or without the prefix cache), attention backend, decode graphs,
scheduler, runner and engine, driven step by step as the engine thread does; and constraints
that keep the logits each row is sampled from (`constraint.TokenConstraint`, the hook the
grammars use), so two runs can be compared row by row, or one teacher-forced by the other.

Nothing here needs more than torch and FlashInfer: the GPU machine has no server dependencies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpu_common import DEVICE, DTYPE

from kvpark.kernels.flashinfer_paged import AttentionShape, FlashInferPagedAttention
from kvpark.kernels.kv_copy import CopyEngine, SyncCopyEngine, Ticket, make_copy_engine
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Sequence
from kvpark.pod.core.step_plan import ScheduledSeq
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.host_tier import HostTier
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.prefix_cache import PrefixCache
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.sampling.sampler import SamplingParams
from kvpark.pod.worker.cuda_graphs import DecodeGraphRunner
from kvpark.pod.worker.runner import ModelRunner

PAGE_SIZE = 16
VOCAB = 49152  # synthetic:smollm2-135m's


def no_graph_capture(forward, mempool):
    """The same graph-mode wrappers and static buffers, run eagerly at each 'replay'."""
    hidden = forward()

    def replay():
        with torch.inference_mode():
            hidden.copy_(forward())

    return replay, hidden


class CountingGraphs(DecodeGraphRunner):
    """Decode graphs that count the steps they ran."""

    replays = 0

    def run(self, input_ids, positions, layout):
        self.replays += 1
        return super().run(input_ids, positions, layout)


class RecordingCopy(CopyEngine):
    """A copy engine that remembers every copy it started (kind, pages, host buffer)."""

    def __init__(self, inner: CopyEngine) -> None:
        self.inner = inner
        self.started: list[Ticket] = []

    def start_park(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        self.started.append(self.inner.start_park(pages, host_buf))
        return self.started[-1]

    def start_resume(self, pages: list[int], host_buf: torch.Tensor) -> Ticket:
        self.started.append(self.inner.start_resume(pages, host_buf))
        return self.started[-1]

    def poll(self, ticket: Ticket) -> bool:
        return self.inner.poll(ticket)

    def wait(self, ticket: Ticket) -> None:
        self.inner.wait(ticket)

    def save(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        self.inner.save(pages, host_pages)

    def load(self, pages: list[int], host_pages: list[torch.Tensor]) -> None:
        self.inner.load(pages, host_pages)


class Stack:
    """One model's serving stack as `pod/serving/stack.py` builds it on CUDA.

    graphs: "graph" (captured, the server's default), "no-graph" (the same graph-mode wrappers
    and buffers run eagerly: the same kernels without a graph) or None (the plain eager path).
    copy: "async" (the CUDA default) or "sync" (--no-preempt-async).
    """

    def __init__(self, model: LlamaModel, *, backend: str = "flashinfer",
                 graphs: str | None = "graph", prefix_cache: bool = True, num_pages: int = 64,
                 num_slots: int = 4, batch_size: int = 512, budget: int = -1,
                 copy: str = "async", eos_ids: frozenset[int] = frozenset(),
                 host_tier: bool = False) -> None:
        c = model.config
        cache = PrefixCache(f"synthetic:smollm2-135m|{DTYPE}", PAGE_SIZE) if prefix_cache \
            else None
        self.pool = KVPool(c.num_layers, num_pages, PAGE_SIZE, c.num_kv_heads, c.head_dim,
                           DTYPE, DEVICE, cache=cache)
        if backend == "flashinfer":
            self.backend = FlashInferPagedAttention(DEVICE, AttentionShape(
                c.num_heads, c.num_kv_heads, c.head_dim, PAGE_SIZE, DTYPE, DTYPE))
        else:
            self.backend = TorchPagedAttention(DEVICE)
        self.graphs: CountingGraphs | None = None
        if graphs is not None and backend == "flashinfer":
            capture = no_graph_capture if graphs == "no-graph" else None
            self.graphs = CountingGraphs(model, self.pool, self.backend, max_batch=num_slots,
                                         capture=capture)
            self.graphs.capture_all()  # takes its scratch page first, as in the server
        inner = SyncCopyEngine(self.pool) if copy == "sync" else make_copy_engine(self.pool)
        self.copy = RecordingCopy(inner)
        self.host = HostStore(budget, pin_memory=DEVICE.type == "cuda")
        if host_tier:  # the prefix cache's host-RAM tier, under the same budget
            self.pool.tier = HostTier(self.host, self.copy, self.pool.host_page_shape, DTYPE)
        config = SchedulerConfig(num_slots=num_slots, batch_size=batch_size,
                                 preempt_high=1.0, preempt_low=1.0)
        self.scheduler = Scheduler(config, self.pool, Swapper(self.pool, self.host, self.copy),
                                   eos_ids)
        self.engine = Engine(self.scheduler, ModelRunner(model, self.pool, self.backend,
                                                         graphs=self.graphs),
                             on_step=self._count_step)
        self.decode_steps = 0  # steps whose every row fed one token (what graphs can run)

    @property
    def cache(self) -> PrefixCache:
        assert self.pool.cache is not None, "this stack runs without a prefix cache"
        return self.pool.cache

    def _count_step(self, plan: list[ScheduledSeq], seconds: float) -> None:
        self.decode_steps += all(item.num_tokens == 1 for item in plan)

    def add(self, *seqs: Sequence) -> None:
        for seq in seqs:
            self.scheduler.add(seq)

    def run(self, *seqs: Sequence, until: Callable[[], bool] | None = None,
            max_steps: int = 2000) -> None:
        """Add `seqs`, then step until nothing is left to do (or `until()` holds)."""
        self.add(*seqs)
        for _ in range(max_steps):
            if (until is not None and until()) or not self.scheduler.has_work:
                return
            self.engine.step()
        raise AssertionError(f"still working after {max_steps} steps")


def random_tokens(num: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num,), generator=gen).tolist()


def make_seq(name: str, prompt: list[int], max_tokens: int, constraint=None,
             ignore_eos: bool = True) -> Sequence:
    """A greedy request (temperature 0), as the API would hand it to the engine."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Sequence(Submission(name, tuple(prompt), params, None, lambda event: None),
                    torch.Generator(), constraint=constraint)


class LogitsRecorder:
    """A `TokenConstraint` that keeps a copy of each row of raw logits it is asked to mask (the
    row the draw would see without it), then hands the row to `inner` (a grammar) and, when
    `forced` is given, allows only the next forced token: a teacher-forced run."""

    def __init__(self, inner=None, forced: list[int] | None = None) -> None:
        self.inner = inner
        self.forced = forced
        self.logits: list[torch.Tensor] = []

    def mask(self, logits: torch.Tensor) -> None:
        self.logits.append(logits.clone())
        if self.inner is not None:
            self.inner.mask(logits)
        if self.forced is not None and len(self.logits) <= len(self.forced):
            token = self.forced[len(self.logits) - 1]
            with torch.inference_mode():  # the model's logits are inference tensors
                keep = logits[token].clone()
                logits.fill_(float("-inf"))
                logits[token] = 0.0 if torch.isinf(keep) else keep

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)

    def is_done(self) -> bool:
        return self.inner is not None and self.inner.is_done()


def logits_rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Per sampled row: |a - b| / |b|, over rows both runs sampled."""
    assert len(a) == len(b), f"{len(a)} rows against {len(b)}"
    return [((x - y).norm() / y.norm()).item() for x, y in zip(a, b)]


def greedy_agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, int]:
    """Rows whose argmax is the same in both runs, of all rows."""
    same = sum(int(x.argmax()) == int(y.argmax()) for x, y in zip(a, b))
    return same, len(a)


def kv_rows(pool: KVPool, table: list[int], num_tokens: int) -> torch.Tensor:
    """The K/V of a page table's first `num_tokens` positions, every layer:
    [layers, 2, tokens, Hkv, D], gathered into a new tensor."""
    pages = torch.tensor(table[:pool.pages_for(num_tokens)], device=pool.device)
    rows = []
    for cache in pool.caches:
        kv = cache[pages]  # [pages, 2, ps, Hkv, D]
        rows.append(kv.transpose(0, 1).reshape(2, -1, *kv.shape[3:])[:, :num_tokens])
    return torch.stack(rows)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal alone would take -0.0 for 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
