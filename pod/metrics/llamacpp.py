"""llama-server's `llamacpp:` metric names, beside the `kvpark:` and `vllm:` series, so the
dashboards llama.cpp users already have read kvpark unchanged.

Same meanings as llama.cpp's server: totals since start for tokens, the seconds spent on prompts
and on generation, and decode calls; throughput gauges as total tokens over total seconds; the
slots processing and the requests deferred (queued or parked) now.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.scheduler import Scheduler
from ..core.sequence import Sequence


class LlamacppTotals:
    """Accumulated on the engine thread (under its lock), read at scrape time under it."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.predicted_tokens = 0
        self.predicted_seconds = 0.0
        self.decode_calls = 0
        self.busy_slots = 0  # summed over decode calls: / decode_calls is the mean batch

    def on_finish(self, seq: Sequence, num_prompt: int) -> None:
        self.prompt_tokens += num_prompt
        self.prompt_seconds += seq.output.prompt_seconds if num_prompt else 0.0
        self.predicted_tokens += seq.num_generated
        output = seq.output
        if output.first_token_at is not None and output.finished_at is not None:
            self.predicted_seconds += output.finished_at - output.first_token_at

    def on_step(self, num_sequences: int) -> None:
        self.decode_calls += 1
        self.busy_slots += num_sequences


def llamacpp_families(scheduler: Scheduler, totals: LlamacppTotals
                      ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The series, read in the same locked scrape as the `kvpark:` ones (metrics.py)."""
    t, s = totals, scheduler
    yield _counter("prompt_tokens", "Number of prompt tokens processed.", t.prompt_tokens)
    yield _counter("prompt_seconds", "Prompt process time", t.prompt_seconds)
    yield _counter("tokens_predicted", "Number of generation tokens processed.",
                   t.predicted_tokens)
    yield _counter("tokens_predicted_seconds", "Predict process time", t.predicted_seconds)
    yield _counter("n_decode", "Total number of llama_decode() calls", t.decode_calls)
    yield _gauge("n_busy_slots_per_decode", "Average number of busy slots per "
                 "llama_decode() call", t.busy_slots / max(1, t.decode_calls))
    yield _gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                 t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0)
    yield _gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                 t.predicted_tokens / t.predicted_seconds if t.predicted_seconds else 0.0)
    yield _gauge("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                 s.pool.usage_ratio)
    yield _gauge("kv_cache_tokens", "KV-cache tokens.",
                 s.pool.num_used_pages * s.pool.page_size)
    yield _gauge("requests_processing", "Number of requests processing.", len(s.running))
    yield _gauge("requests_deferred", "Number of requests deferred.",
                 len(s.waiting) + len(s.parked))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"llamacpp:{name}", doc, value=value)
