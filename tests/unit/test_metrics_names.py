"""/metrics names: vLLM's aliases with `model_name`, TTFT and inter-token latency histograms
with one sample per token gap, prompts counted once per prompt, no `_created` series. A real
scheduler and engine with a fake runner (no model)."""

import torch

from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import FinishReason, Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Sequence
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.metrics.prometheus import Metrics
from kvpark.pod.sampling.sampler import ChunkOutput, Sampled, SamplingParams


class FakeRunner:
    def run(self, plan):
        return [ChunkOutput(Sampled(7) if item.samples else None) for item in plan]


def make_engine() -> tuple[Engine, Metrics]:
    pool = KVPool(num_layers=1, num_pages=32, page_size=4, num_kv_heads=1, head_dim=2)
    swapper = Swapper(pool, HostStore(0))
    scheduler = Scheduler(SchedulerConfig(num_slots=4, batch_size=64), pool, swapper,
                          frozenset({3}))
    metrics = Metrics(scheduler, swapper.host, swapper.copy_times, model_name="kv-test")
    scheduler.on_finish = metrics.on_finish
    return Engine(scheduler, FakeRunner(), on_step=metrics.on_step), metrics


def make_seq(prompt_len: int, max_tokens: int, index: int = 0, family: int = 1) -> Sequence:
    return Sequence(Submission("r", (1,) * prompt_len, SamplingParams(max_tokens=max_tokens),
                               None, lambda *a: None, index=index, family_size=family),
                    torch.Generator())


def scrape(metrics: Metrics) -> dict[str, float]:
    text = metrics.render().decode()
    assert "_created" not in text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_aliases_histograms_and_prompt_counts():
    engine, metrics = make_engine()
    # a batched request: two prompts (5 and 6 tokens) with n=2 each -> choices 0..3
    seqs = [make_seq(5, 4, 0, 2), make_seq(5, 4, 1, 2), make_seq(6, 4, 2, 2),
            make_seq(6, 4, 3, 2)]
    for seq in seqs:
        engine.scheduler.add(seq)
    label = '{model_name="kv-test"}'
    assert scrape(metrics)[f"vllm:num_requests_waiting{label}"] == 4
    while engine.step():
        pass
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_generated == 4 for s in seqs)
    values = scrape(metrics)
    assert values["kvpark:prompt_tokens_total"] == 11 == values[f"vllm:prompt_tokens_total{label}"]
    assert values[f"vllm:generation_tokens_total{label}"] == 16
    assert values['vllm:request_success_total{finished_reason="length",model_name="kv-test"}'] == 4
    assert values["kvpark:time_to_first_token_seconds_count"] == 4
    assert values[f"vllm:time_to_first_token_seconds_count{label}"] == 4
    assert values["kvpark:inter_token_latency_seconds_count"] == 4 * 3  # gaps between 4 tokens
    assert values[f"vllm:inter_token_latency_seconds_count{label}"] == 12
    assert values[f"vllm:num_requests_running{label}"] == 0
    assert values[f"vllm:kv_cache_usage_perc{label}"] == values["kvpark:kv_cache_usage_ratio"]
    assert not metrics.last_token_at  # nothing kept for finished sequences


def test_a_cancelled_sequence_leaves_nothing_behind():
    engine, metrics = make_engine()
    seq = make_seq(4, 50)
    engine.scheduler.add(seq)
    for _ in range(3):
        engine.step()
    assert seq.seq_id in metrics.last_token_at
    engine.scheduler.finish(seq, FinishReason.CANCELLED)
    assert not metrics.last_token_at
    assert scrape(metrics)["kvpark:inter_token_latency_seconds_count"] == 2  # 3 tokens
