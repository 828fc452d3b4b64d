"""Prometheus metrics under the `kvpark:` prefix, plus vLLM's and llama.cpp's names for what
they share (`llamacpp.py`).

Counters the scheduler already keeps (parks, resumes, pool and host usage) are read live at
scrape time by a collector; per-request and per-step facts are observed as they happen.

The `vllm:` aliases carry vLLM's `model_name` label so dashboards, autoscalers and routers made
for vLLM read kvpark unchanged; the `kvpark:` series keep their names and labels.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..core.messages import FinishReason
from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..core.speculation import SpecStats
from ..core.step_plan import ScheduledSeq
from ..core.swap import CopyTimes
from ..memory.disk_store import DiskStats
from ..memory.disk_tier import DiskTier, DiskTierStats
from ..memory.host_store import HostStore
from ..memory.host_tier import HostTier, TierStats
from ..memory.kv_pool import KVPool
from .llamacpp import LlamacppTotals, llamacpp_families

disable_created_metrics()  # no `_created` series: half the scrape, read by nobody

# vLLM's buckets (v1 metrics), so its dashboards' quantiles mean the same here
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
COPY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 16, 32, 64)
PARKS_BUCKETS = (0, 1, 2, 3, 5, 8, 13, 21, 50)


class SchedulerCollector(Collector):
    """Reads the scheduler's state at scrape time, on the engine's lock (one consistent read)."""

    def __init__(self, scheduler: Scheduler, host: HostStore, lock: threading.RLock,
                 model_name: str, llamacpp: LlamacppTotals) -> None:
        self.scheduler = scheduler
        self.host = host
        self.lock = lock
        self.model_name = model_name
        self.llamacpp = llamacpp

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self.lock:
            families = [*self._families(), *llamacpp_families(self.scheduler, self.llamacpp)]
        yield from families

    def _families(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.scheduler
        stats = s.stats
        yield _vllm_gauge("num_requests_running", "Sequences running (kvpark:requests_processing)",
                          self.model_name, len(s.running))
        # vLLM puts preempted requests back in its waiting queue: parked ones count as waiting
        yield _vllm_gauge("num_requests_waiting", "Sequences queued or parked",
                          self.model_name, len(s.waiting) + len(s.parked))
        yield _vllm_gauge("kv_cache_usage_perc", "KV-cache usage, 0..1 "
                          "(kvpark:kv_cache_usage_ratio)", self.model_name, s.pool.usage_ratio)
        yield _cache_config_info(s.pool, self.host)
        yield _gauge("requests_processing", "Sequences holding a slot and running",
                     len(s.running))
        yield _gauge("requests_deferred", "Sequences queued for a slot", len(s.waiting))
        yield _gauge("requests_preempted", "Sequences parked now", len(s.parked))
        yield _gauge("kv_cache_usage_ratio", "Used fraction of the paged KV pool",
                     s.pool.usage_ratio)
        yield _gauge("kv_cache_pages_total", "Pages in the KV pool", s.pool.num_pages)
        yield _gauge("kv_cache_pages_free", "Free pages in the KV pool", s.pool.num_free_pages)
        yield _gauge("kv_cache_page_bytes", "Bytes of one page across the attention layers",
                     s.pool.page_bytes)
        # a hybrid model's second kind of memory: a state slot per slot (0 for other models)
        yield _gauge("state_slot_bytes", "Bytes of one sequence's recurrent state (conv + "
                     "delta rule) across the DeltaNet layers", s.pool.state_bytes)
        yield _gauge("state_slots_total", "State slots (one per --parallel slot)",
                     s.pool.states.num_slots if s.pool.states is not None else 0)
        yield _gauge("state_slots_used", "State slots a running sequence holds (a parked one "
                     "gave its up)", len(s.running) if s.pool.states is not None else 0)
        checkpoints = s.pool.checkpoints
        yield _gauge("state_checkpoints", "State checkpoints kept (a hybrid model's cached "
                     "prefixes are usable up to one)",
                     len(checkpoints) if checkpoints is not None else 0)
        yield _gauge("state_checkpoint_bytes", "Host bytes the state checkpoints hold (inside "
                     "--preempt-ram)", checkpoints.bytes if checkpoints is not None else 0)
        yield _gauge("state_checkpoints_in_pool", "State checkpoints in the pool's memory "
                     "(--ctx-checkpoints per slot)",
                     checkpoints.num_in_pool if checkpoints is not None else 0)
        yield _gauge("state_checkpoint_pool_bytes", "Pool memory set aside for state "
                     "checkpoints", checkpoints.pool_bytes if checkpoints is not None else 0)
        taken = checkpoints.stats if checkpoints is not None else None
        yield _counter("state_checkpoint_hits", "Admissions and resumes that started from a "
                       "state checkpoint", taken.hits if taken else 0)
        yield _counter("state_checkpoint_tokens", "Tokens those did not compute (K/V from the "
                       "prefix cache, state from the checkpoint)", taken.tokens if taken else 0)
        yield _counter("state_checkpoint_evictions", "State checkpoints dropped for room",
                       taken.evictions if taken else 0)
        yield _counter("state_checkpoint_moves_to_host", "State checkpoints moved out of the "
                       "pool's memory to host RAM for a newer one",
                       taken.moved_to_host if taken else 0)
        yield _gauge("kv_cache_pages_cached", "Pages nobody holds, kept for the prefix cache "
                     "(evictable: counted free)", s.pool.num_cached_pages)
        cache = s.pool.cache.stats if s.pool.cache is not None else None
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                       cache.queries if cache else 0)
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                       cache.hits if cache else 0)
        yield _counter("prefix_cache_evictions", "Cached pages evicted for new content",
                       cache.evictions if cache else 0)
        tier = s.pool.tier
        cached_on_host = (tier.cached_bytes if tier is not None else 0) + (
            s.pool.checkpoints.bytes if s.pool.checkpoints is not None else 0)
        yield _gauge("preempt_ram_bytes", "Host bytes held by parked sequences now",
                     self.host.held_bytes - cached_on_host)
        yield _gauge("preempt_ram_budget_bytes", "Host byte budget for parked sequences and "
                     "the host cache together (-1: no limit)", self.host.budget_bytes)
        yield _gauge("host_ram_peak_bytes", "Most host bytes held at once, parked and cached "
                     "together (never past the budget)", self.host.peak_bytes)
        yield from _host_cache_families(tier)
        yield from _disk_cache_families(s.pool.disk)
        yield from _spec_decode_families(s.speculator.stats, self.model_name)
        yield _spec_type_family(s.speculator.config.kind)
        yield _counter("decode_rows_held", "Decode rows that sat a step out while prompts "
                       "waited (--prefill-first)", s.candidates.held)
        yield _counter("n_preempt", "Parks, swap and recompute", stats.n_preempt)
        yield _counter("n_resume", "Resumes of parked sequences", stats.n_resume)
        yield _counter("n_preempt_swap", "Parks by copying pages to host RAM",
                       stats.n_preempt_swap)
        yield _counter("n_preempt_recompute", "Parks by dropping pages to re-prefill later",
                       stats.n_preempt_recompute)
        yield _counter("n_recompute_tokens", "Tokens re-prefilled by recompute resumes",
                       stats.n_recompute_tokens)
        yield _counter("n_preempt_cached", "Parks restored from the prefix cache with nothing "
                       "replayed (a subset of n_preempt)", stats.n_preempt_cached)
        yield _counter("n_preempt_swap_fallback", "Swaps refused by host RAM, recomputed",
                       stats.n_swap_fallbacks)
        ps = s.pool.page_size
        yield _gauge("preempt_high_watermark_cells", "Pool cells past which a step parks first",
                     s.high_pages * ps)
        yield _gauge("preempt_low_watermark_cells", "Pool cells below which restores happen",
                     s.low_pages * ps)
        yield _counter("n_preempt_watermark", "Parks made before the wall (high watermark)",
                       stats.n_watermark_parks)
        yield _counter("n_preempt_reader", "Parks of streams whose client fell behind reading "
                       "(--max-stream-backlog)", stats.n_reader_parks)
        yield _counter("n_restore_refused_watermark",
                       "Restores that fit but were held back by the low watermark",
                       stats.n_restore_refused_watermark)


def _host_cache_families(tier: HostTier | None) -> Iterator[GaugeMetricFamily |
                                                             CounterMetricFamily]:
    """The host tier of the prefix cache (zeros when it is off)."""
    stats = tier.stats if tier is not None else TierStats()
    yield _gauge("host_cache_bytes", "Host bytes of cached prefix pages nobody holds "
                 "(inside the preempt-ram budget; parks drop them first)",
                 tier.cached_bytes if tier is not None else 0)
    yield _gauge("host_cache_pages", "Pages in the host cache, held by parks or cached",
                 tier.num_pages if tier is not None else 0)
    yield _counter("host_cache_lookups", "Pages looked up in the host cache after the pool "
                   "missed them", stats.lookups)
    yield _counter("host_cache_hits", "Pages copied back from the host cache", stats.hits)
    yield _counter("host_cache_saves", "Pages the pool evicted, copied to the host cache",
                   stats.saves)
    yield _counter("host_cache_skipped", "Pages the pool evicted with no room in host RAM",
                   stats.skipped)
    yield _counter("host_cache_evictions", "Cached host pages dropped for room", stats.drops)


def _disk_cache_families(disk: DiskTier | None) -> Iterator[GaugeMetricFamily |
                                                             CounterMetricFamily]:
    """The disk tier of the prefix cache, --cache-disk (zeros when it is off)."""
    files = disk.store.stats if disk is not None else DiskStats()
    tier = disk.stats if disk is not None else DiskTierStats()
    yield _gauge("disk_cache_bytes", "Bytes of page files in the disk tier's folder (every "
                 "server sharing it), as of its latest count", files.bytes)
    yield _gauge("disk_cache_writable", "1 while the disk tier writes (0: off, or the disk "
                 "filled up and it stopped)", int(disk is not None and disk.store.writable))
    yield _gauge("disk_cache_queued_bytes", "Bytes waiting for the disk tier's writer (host "
                 "RAM outside the preempt-ram budget, capped)",
                 disk.writer.pending_bytes if disk is not None else 0)
    yield _counter("disk_cache_lookups", "Pages looked up on disk after the pool and host RAM "
                   "missed them", tier.lookups)
    yield _counter("disk_cache_hits", "Pages read back from the disk tier", files.hits)
    yield _counter("disk_cache_writes", "Pages written to the disk tier", files.writes)
    yield _counter("disk_cache_write_bytes", "Bytes written to the disk tier", files.write_bytes)
    yield _counter("disk_cache_dropped", "Pages not written: the writer's queue was full",
                   tier.dropped)
    yield _counter("disk_cache_rejected", "Files refused (another model's, truncated, damaged) "
                   "and removed", files.rejected)
    yield _counter("disk_cache_evictions", "Files deleted for room, least recently used first",
                   files.evicted)
    yield _counter("disk_cache_slow_reads", "Lookups whose reading was cut short after 1 s "
                   "(the rest of the prefix is computed)", tier.slow_reads)
    yield _counter("disk_cache_write_out_pages", "Pages written at shutdown (the drain's "
                   "write-out)", tier.write_out_pages)


def _spec_decode_families(stats: SpecStats, model_name: str) -> Iterator[CounterMetricFamily]:
    """Speculative decoding (`--spec-type`): vLLM's spec_decode_* names and kvpark's own.
    The acceptance rate is accepted / draft tokens (vLLM's dashboards divide the same two)."""
    for name, doc, value in (
            ("num_drafts", "Verifications of a draft", stats.num_drafts),
            ("num_draft_tokens", "Draft tokens fed to the model", stats.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens the samples matched",
             stats.num_accepted_tokens)):
        yield _counter(f"spec_decode_{name}", doc, value)
        family = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family


def _spec_type_family(kind: str) -> GaugeMetricFamily:
    """Which drafter the spec_decode_* counters count (one per server): its `--spec-type`."""
    family = GaugeMetricFamily("kvpark:spec_decode_type", "The drafter: --spec-type (1 for the "
                               "one this server runs)", labels=["spec_type"])
    family.add_metric([kind], 1)
    return family


def _cache_config_info(pool: KVPool, host: HostStore) -> GaugeMetricFamily:
    """vLLM's `vllm:cache_config_info` (a gauge of 1 whose labels are the cache's config):
    llm-d's router reads `block_size` and `num_gpu_blocks` from it. Blocks are pages; the
    host tier's blocks are what the --preempt-ram budget could hold."""
    tier = pool.tier
    info = {"block_size": str(pool.page_size), "num_gpu_blocks": str(pool.num_pages),
            "num_cpu_blocks": str(host.budget_bytes // tier.page_bytes
                                  if tier and host.budget_bytes >= 0 else 0),
            "enable_prefix_caching": str(pool.cache is not None),
            "cache_dtype": str(pool.dtype).removeprefix("torch."),
            "prefix_caching_hash_algo": "sha256", "engine": "0"}
    family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                               "CacheConfig", labels=list(info))
    family.add_metric(list(info.values()), 1)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvpark:{name}", doc, value=value)


def _vllm_gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kvpark:{name}", doc, value=value)


class Metrics:
    """The scheduler's decisions, and the memory layer's host store and copy times, which the
    wiring hands over (metrics does not reach through the scheduler into the memory layer)."""

    def __init__(self, scheduler: Scheduler, host: HostStore, copy_times: CopyTimes,
                 lock: threading.RLock | None = None, model_name: str = "kvpark") -> None:
        self.scheduler = scheduler
        self.copy_times = copy_times
        self.registry = CollectorRegistry()
        self.llamacpp = LlamacppTotals()
        self.registry.register(SchedulerCollector(scheduler, host, lock or threading.RLock(),
                                                  model_name, self.llamacpp))
        # seq_id -> (when its latest token came, tokens generated then)
        self.last_token_at: dict[int, tuple[float, int]] = {}
        r = self.registry
        self.prompt_tokens = Counter("kvpark:prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generated_tokens = Counter("kvpark:tokens_predicted", "Tokens generated",
                                        registry=r)
        self.requests = Counter("kvpark:requests", "Finished requests by outcome",
                                ["outcome"], registry=r)
        self.preparing = Gauge("kvpark:requests_preparing",
                               "Requests whose body is being parsed, templated and tokenised",
                               registry=r)
        self.rejected = Counter("kvpark:requests_rejected", "Requests rejected (503, full)",
                                registry=r)
        self.latency = Histogram("kvpark:request_latency_seconds", "Arrival to last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvpark:time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvpark:inter_token_latency_seconds",
                             "Between two tokens of a sequence (parked time included)",
                             buckets=ITL_BUCKETS, registry=r)
        self.vllm = VllmAliases(r, model_name)
        self.step_seconds = Histogram("kvpark:step_seconds", "Model step duration",
                                      buckets=COPY_BUCKETS + (5, 10), registry=r)
        self.decode_batch = Histogram("kvpark:decode_batch_size",
                                      "Sequences decoding one token in a step",
                                      buckets=BATCH_BUCKETS, registry=r)
        self.park_copy = Histogram("kvpark:preempt_park_seconds",
                                   "Duration of a swap park (pages to host)",
                                   buckets=COPY_BUCKETS, registry=r)
        self.resume_copy = Histogram("kvpark:preempt_resume_seconds",
                                     "Duration of a swap resume (host to pages)",
                                     buckets=COPY_BUCKETS, registry=r)
        self.host_save = Histogram("kvpark:host_cache_save_seconds",
                                   "Copying a batch of evicted pages to the host cache",
                                   buckets=COPY_BUCKETS, registry=r)
        self.host_load = Histogram("kvpark:host_cache_load_seconds",
                                   "Copying a run of pages back from the host cache",
                                   buckets=COPY_BUCKETS, registry=r)

        self.request_preemptions = Histogram(
            "kvpark:request_preemptions", "Parks per finished request",
            buckets=PARKS_BUCKETS, registry=r)
        self.request_parked = Histogram(
            "kvpark:request_parked_seconds", "Time parked per finished request",
            buckets=(0,) + LATENCY_BUCKETS, registry=r)

    def on_step(self, plan: list[ScheduledSeq], seconds: float) -> None:
        self.step_seconds.observe(seconds)
        self.llamacpp.on_step(len(plan))
        self.observe_tokens(plan)
        decoding = sum(1 for item in plan if item.num_tokens == 1 and item.samples)
        if decoding:
            self.decode_batch.observe(decoding)
        tier = self.scheduler.pool.tier
        drained = [(self.copy_times.park, self.park_copy),
                   (self.copy_times.resume, self.resume_copy)]
        if tier is not None:
            drained += [(tier.stats.save_seconds, self.host_save),
                        (tier.stats.load_seconds, self.host_load)]
        for observed, histogram in drained:
            while observed:
                histogram.observe(observed.pop())

    def observe_tokens(self, plan: list[ScheduledSeq]) -> None:
        """Inter-token latency: per new token, the time since the sequence's previous one.
        Runs after the step's postprocessing (which may have finished a sequence): new tokens
        are counted, not read from the plan."""
        now = time.monotonic()
        for item in plan:
            seq = item.seq
            seen = self.last_token_at.get(seq.seq_id)
            if seen is not None and seq.num_generated > seen[1]:
                self.itl.observe(now - seen[0])
                self.vllm.itl.observe(now - seen[0])
            if seq.is_finished:
                self.last_token_at.pop(seq.seq_id, None)
            elif seq.num_generated and (seen is None or seq.num_generated > seen[1]):
                self.last_token_at[seq.seq_id] = (now, seq.num_generated)

    def on_finish(self, seq: Sequence) -> None:
        outcome = "error" if seq.failed else seq.finish_reason.value
        self.requests.labels(outcome).inc()
        self.request_preemptions.observe(seq.parking.n_preempt)
        self.request_parked.observe(seq.parking.seconds)
        # the n sequences of a prompt share it: count it once (a batched request has several)
        num_prompt = seq.num_prompt if seq.index % seq.family_size == 0 else 0
        self.prompt_tokens.inc(num_prompt)
        self.generated_tokens.inc(seq.num_generated)
        latency = time.monotonic() - seq.arrival
        self.latency.observe(latency)
        first_token_at = seq.output.first_token_at
        if first_token_at is not None:
            self.ttft.observe(first_token_at - seq.arrival)
            self.vllm.ttft.observe(first_token_at - seq.arrival)
        if seq.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            self.last_token_at.pop(seq.seq_id, None)  # no step will see it again: no leak
        self.vllm.on_finish(outcome, num_prompt, seq.num_generated, latency)
        self.llamacpp.on_finish(seq, num_prompt)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmAliases:
    """vLLM's request and token series, labelled with the served model name."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token",
                              label, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Between two tokens",
                             label, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.latency = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token",
                                 label, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens received", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", label,
                                         registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=r)
        self.model_name = model_name

    def on_finish(self, outcome: str, num_prompt: int, num_generated: int,
                  latency: float) -> None:
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.latency.observe(latency)
        if outcome != "error":  # vLLM counts successes only
            self.success.labels(self.model_name, outcome).inc()
