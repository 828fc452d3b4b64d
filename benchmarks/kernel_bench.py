"""The CPU kernels against each other, in alternating rounds in one process (ratios hold on a
shared machine): decode rows from GGUF blocks vs float32 oneDNN, per ISA build and thread count;
paged attention per ISA and thread count; decode rows' attention over a float32 and a bf16
pool, a pool per layer as a decode step reads them (`--cache-type-k/v`); a prompt's attention in
float32 and on AMX tiles (where AMX runs); prompt rows (512) through oneDNN at 1 and 2 torch
threads vs the block kernel.

    python benchmarks/kernel_bench.py                  # every runnable ISA, 1 and 2 threads
    python benchmarks/kernel_bench.py --only decode    # one group

Each case is the MLP linears (gate_up, down) of every layer of SmolLM2-135M, as a decode step
reads them: more bytes than the caches hold. Times are the best of `--rounds` wall times.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvpark.kernels import amx_gemm, worker_pool
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.cpu_features import detect
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.kernels.quant_linear import quant_linear
from kvpark.pod.model.linear import MIN_INVARIANT_ROWS, pad_rows
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.loader import load_model_files

Case = tuple[str, Callable[[], object], int, int]  # name, run, torch threads, kernel threads


def mlp_cases(model: LlamaModel, rows: int, isas, threads: list[int]) -> list[Case]:
    layers = model.layers
    x = torch.randn(rows, model.config.hidden_size)
    mid = torch.randn(rows, model.config.intermediate_size)

    def blocks(isa, n):
        def run():
            for layer in layers:
                quant_linear(x, layer.gate_up.blocks, isa, n)
                quant_linear(mid, layer.down.blocks, isa, n)
        return run

    def dense():
        for layer in layers:
            layer.gate_up.dense(pad_rows(x, MIN_INVARIANT_ROWS))
            layer.down.dense(pad_rows(mid, MIN_INVARIANT_ROWS))

    cases = [(f"{rows} rows blocks {isa.value} k{n}", blocks(isa, n), 1, n)
             for isa in isas for n in threads]
    return cases + [(f"{rows} rows oneDNN fp32 t{n}", dense, n, 1) for n in threads]


def attention_cases(model: LlamaModel, batch: int, context: int, isas,
                    threads: list[int]) -> list[Case]:
    c = model.config
    page = 16
    pages = -(-context // page)
    cache = torch.randn(batch * pages, 2, page, c.num_kv_heads, c.head_dim)
    q = torch.randn(batch, c.num_heads, c.head_dim)
    layout = StepLayout([list(range(i * pages, (i + 1) * pages)) for i in range(batch)],
                        [context] * batch, [1] * batch, page)

    return [(f"attention b{batch} ctx{context} {isa.value} k{n}",
             every_layer(model, CpuPagedAttention(isa=isa, num_threads=n), layout, q, cache), 1,
             n) for isa in isas for n in threads]


def every_layer(model: LlamaModel, backend: CpuPagedAttention, layout: StepLayout,
                q: torch.Tensor, cache: torch.Tensor) -> Callable[[], None]:
    """One step's attention in every layer of the model (one cache stands for each)."""
    backend.plan(layout)

    def run():
        for _ in range(model.config.num_layers):
            backend.attend(q, cache)
    return run


def kv_dtype_cases(model: LlamaModel, batch: int, context: int,
                   threads: list[int]) -> list[Case]:
    """Decode rows of `batch` sequences of `context` tokens through every layer's attention,
    each layer its own pool (scattered pages: what a step streams from memory), float32 and
    bf16 K/V holding the same values."""
    c = model.config
    page = 16
    pages = -(-context // page)
    order = torch.randperm(batch * pages).tolist()
    layout = StepLayout([order[i * pages:(i + 1) * pages] for i in range(batch)],
                        [context] * batch, [1] * batch, page)
    q = torch.randn(batch, c.num_heads, c.head_dim)
    pools = {torch.float32: [torch.randn(batch * pages, 2, page, c.num_kv_heads, c.head_dim)
                             for _ in range(c.num_layers)]}
    pools[torch.bfloat16] = [pool.bfloat16() for pool in pools[torch.float32]]

    def step(backend: CpuPagedAttention, caches: list[torch.Tensor]) -> Callable[[], None]:
        backend.plan(layout)

        def run():
            for cache in caches:
                backend.attend(q, cache)
        return run

    return [(f"decode b{batch} ctx{context} {str(dtype)[6:]} k{n}",
             step(CpuPagedAttention(num_threads=n), caches), 1, n)
            for n in threads for dtype, caches in pools.items()]


def prompt_attention_cases(model: LlamaModel, length: int, threads: list[int]) -> list[Case]:
    """One prompt of `length` tokens through every layer's attention: the float32 kernel, and
    the prompt rows' AMX tile kernel where AMX runs (`--amx`)."""
    c = model.config
    page = 16
    pages = -(-length // page)
    cache = torch.randn(pages, 2, page, c.num_kv_heads, c.head_dim)
    q = torch.randn(length, c.num_heads, c.head_dim)
    kinds = [False] + ([True] if amx_gemm.usable() else [])

    return [(f"prompt attention {length} {'amx' if amx else 'fp32'} k{n}",
             every_layer(model, CpuPagedAttention(num_threads=n, amx_prompt_rows=amx),
                         StepLayout([list(range(pages))], [length], [length], page,
                                    [length] if amx else None), q, cache), 1, n)
            for n in threads for amx in kinds]


def measure(cases: list[Case], rounds: int) -> dict[str, float]:
    best = {name: math.inf for name, *_ in cases}
    for _name, run, torch_threads, _ in cases:  # warm-up: builds, first touches, pool
        torch.set_num_threads(torch_threads)
        run()
    for _ in range(rounds):
        for name, run, torch_threads, kernel_threads in cases:
            torch.set_num_threads(torch_threads)
            worker_pool.set_num_threads(kernel_threads)
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m")
    groups = ["decode", "attention", "kv-dtype", "prompt-attention", "prefill"]
    p.add_argument("--only", choices=groups, nargs="+", default=groups)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/kernel_bench.json")
    args = p.parse_args()
    loaded = load_model_files(args.model)
    model = LlamaModel(loaded.config, loaded.weights, quantized=loaded.quantized)
    isas = detect().isas[:2]
    # built when measured: the kv-dtype pools alone take ~2 GB
    groups: dict[str, Callable[[], list[Case]]] = {
        "decode": lambda: mlp_cases(model, 1, isas, args.threads)
        + mlp_cases(model, 4, isas, args.threads),
        "attention": lambda: attention_cases(model, 1, 1000, isas, args.threads)
        + attention_cases(model, 4, 1000, isas, args.threads),
        "kv-dtype": lambda: kv_dtype_cases(model, 32, 400, args.threads)
        + kv_dtype_cases(model, 8, 2000, args.threads),
        "prompt-attention": lambda: prompt_attention_cases(model, 330, args.threads)
        + prompt_attention_cases(model, 1024, args.threads),
        "prefill": lambda: mlp_cases(model, 512, isas[:1], args.threads),
    }
    results = {}
    with torch.inference_mode():
        for group in args.only:
            times = measure(groups[group](), args.rounds)
            first = next(iter(times.values()))
            print(f"\n{group} (best of {args.rounds}; ratio to the first row)")
            for name, seconds in times.items():
                print(f"  {name:<40} {seconds * 1e3:9.2f} ms  {seconds / first:5.2f}x")
            results[group] = times
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
