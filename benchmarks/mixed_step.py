"""A mixed CPU step (decode rows of running sequences, then a prompt chunk, as a burst of chats
makes them): rows of each kind taken as views and put back as one copy (`BlockRows` runs) against
gathered and scattered (`index_select` / `index_copy_`); and the same rows split into a decode
step and a prompt step (what `--prefill-first` does with held decode rows once they come due),
in alternating rounds in one process.

    python benchmarks/mixed_step.py --decode-rows 31 --context 400 --prompt-rows 481

The model runs as the server runs it where AMX runs (amx-bf16 prompt linears, blocks for decode
rows, a bf16 pool); elsewhere with float32 prompt linears and a float32 pool. Prints the median
step times and the median of the per-round ratios; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from kvpark.kernels import amx_gemm, worker_pool
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.cpu_paged import CpuPagedAttention
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.model.linear import BlockRows, WeightFormat
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.loader import load_model_files

PAGE = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--decode-rows", type=int, default=31)
    p.add_argument("--context", type=int, default=400, help="tokens each decode row attends")
    p.add_argument("--prompt-rows", type=int, default=481)
    p.add_argument("--kernel-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/mixed_step.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    worker_pool.set_num_threads(args.kernel_threads)
    amx = amx_gemm.usable()
    loaded = load_model_files(args.model)
    model = LlamaModel(loaded.config, loaded.weights, quantized=loaded.quantized,
                       weight_format=WeightFormat.AMX_BF16 if amx else WeightFormat.FP32)
    c, d, n = model.config, args.decode_rows, args.prompt_rows
    kv_lens, q_lens = [args.context + 1] * d + [n], [1] * d + [n]
    pool = KVPool(c.num_layers, sum(-(-k // PAGE) for k in kv_lens), PAGE, c.num_kv_heads,
                  c.head_dim, dtype=torch.bfloat16 if amx else torch.float32)
    for cache in pool.caches:
        cache.normal_()
    tables = [pool.allocate(pool.pages_for(k)) for k in kv_lens]
    backend = CpuPagedAttention(amx_prompt_rows=amx)
    ids = torch.randint(0, c.vocab_size, (d + n,))
    positions = torch.cat([torch.full((d,), args.context), torch.arange(n)])
    views = BlockRows.from_mask([True] * d + [False] * n)
    variants = {"gathered": dataclasses.replace(views, blocks_run=None, dense_run=None),
                "views": views}

    def step(part: slice, rows: BlockRows) -> float:
        """The sequences `part` of the step (their rows `rows`) as one model call."""
        prompt_rows = [0] * d + [n]
        backend.plan(StepLayout(tables[part], kv_lens[part], q_lens[part], PAGE,
                                prompt_rows[part]))
        first, stop = sum(q_lens[:part.start or 0]), sum(q_lens[:part.stop])
        started = time.perf_counter()
        model(ids[first:stop], positions[first:stop], backend, pool.caches, rows)
        return time.perf_counter() - started

    every, decode, prompt = slice(0, d + 1), slice(0, d), slice(d, d + 1)
    runs = {**{name: lambda rows=rows: step(every, rows) for name, rows in variants.items()},
            "split": lambda: (step(decode, BlockRows.from_mask([True] * d))
                              + step(prompt, BlockRows.from_mask([False] * n)))}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():
            run()  # warm-up
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 else list(runs)[::-1]):
                times[name].append(runs[name]())
    ratios = [g / v for g, v in zip(times["gathered"], times["views"])]
    split_ratios = [v / s for v, s in zip(times["views"], times["split"])]
    print(f"{d} decode rows x {args.context} tokens + {n} prompt rows, {args.rounds} rounds "
          f"({'amx-bf16' if amx else 'fp32'} prompt linears)")
    print("| rows taken | median step ms |\n|---|---|")
    for name, values in times.items():
        label = "split (a decode step + a prompt step)" if name == "split" else name
        print(f"| {label} | {statistics.median(values) * 1e3:.1f} |")
    print(f"gathered / views: {statistics.median(ratios):.3f}x "
          f"(views faster in {sum(x > 1 for x in ratios)}/{len(ratios)} rounds)")
    print(f"mixed (views) / split: {statistics.median(split_ratios):.3f}x "
          f"(split faster in {sum(x > 1 for x in split_ratios)}/{len(split_ratios)} rounds)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "times": times, "ratios": ratios,
                               "mixed_over_split": split_ratios}, indent=2))


if __name__ == "__main__":
    main()
