"""A prompt-only CPU step on AMX: every layer in one C call (`PromptStack`) against the Python
layer loop making the same kernel calls, in alternating rounds in one process.

    python benchmarks/prompt_stack.py --prompts 330 182 --rounds 30

The model runs as the server runs it where AMX runs (amx-bf16 prompt linears, the AMX prompt
attention, a bf16 pool); the prompts start at position 0 and fill one step. Prints the median
step times, the median of the per-round ratios and whether the hidden states are the same bits;
writes JSON. Needs AMX (exits 2 elsewhere: no other CPU takes the stack).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
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
    p.add_argument("--prompts", type=int, nargs="+", default=[330, 182],
                   help="prompt lengths of the step (tokens from position 0)")
    p.add_argument("--kernel-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/prompt_stack.json")
    args = p.parse_args()
    if not amx_gemm.usable():
        print("prompt_stack.py: AMX does not run here; the prompt stack needs it", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    worker_pool.set_num_threads(args.kernel_threads)
    loaded = load_model_files(args.model)
    model = LlamaModel(loaded.config, loaded.weights, quantized=loaded.quantized,
                       weight_format=WeightFormat.AMX_BF16)
    del loaded
    gc.collect()
    gc.freeze()  # the loader's objects would make every collection in a round slow
    stack = model.prompt_stack
    if stack is None:
        print(f"prompt_stack.py: {args.model}'s layers do not all take the AMX path",
              file=sys.stderr)
        sys.exit(2)
    c, lens = model.config, args.prompts
    pool = KVPool(c.num_layers, sum(-(-k // PAGE) for k in lens), PAGE, c.num_kv_heads,
                  c.head_dim, dtype=torch.bfloat16)
    tables = [pool.allocate(pool.pages_for(k)) for k in lens]
    backend = CpuPagedAttention(amx_prompt_rows=True)
    ids = torch.randint(0, c.vocab_size, (sum(lens),))
    positions = torch.cat([torch.arange(k) for k in lens])
    rows = BlockRows.from_mask([False] * sum(lens))

    def step(with_stack: bool) -> tuple[float, torch.Tensor]:
        model.prompt_stack = stack if with_stack else None
        backend.plan(StepLayout(tables, lens, lens, PAGE, lens))
        started = time.perf_counter()
        hidden = model(ids, positions, backend, pool.caches, rows)
        return time.perf_counter() - started, hidden

    times: dict[str, list[float]] = {"stack": [], "loop": []}
    hidden: dict[str, torch.Tensor] = {}
    for r in range(args.rounds):
        for name in ("stack", "loop") if r % 2 == 0 else ("loop", "stack"):
            seconds, hidden[name] = step(name == "stack")
            times[name].append(seconds)
    ratios = [a / b for a, b in zip(times["stack"], times["loop"])]
    result = {"prompts": lens, "rounds": args.rounds, "kernel_threads": args.kernel_threads,
              "stack_ms": statistics.median(times["stack"]) * 1e3,
              "loop_ms": statistics.median(times["loop"]) * 1e3,
              "ratio": statistics.median(ratios),
              "stack_faster_rounds": sum(r < 1 for r in ratios),
              "same_bits": torch.equal(hidden["stack"], hidden["loop"])}
    print("| prompts | stack ms | layer loop ms | stack / loop (median of rounds) | faster in "
          "| same bits |")
    print("|---|---|---|---|---|---|")
    print(f"| {' + '.join(map(str, lens))} | {result['stack_ms']:.1f} | {result['loop_ms']:.1f} "
          f"| {result['ratio']:.3f} | {result['stack_faster_rounds']}/{args.rounds} "
          f"| {result['same_bits']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
