"""Prompt-row GEMMs: kvpark's AMX bf16 tile kernel against what the server runs today, in
alternating rounds in one process (ratios hold on a shared machine; issue 41, first step).

    python benchmarks/amx_gemm.py                     # SmolLM2-135M and Qwen3.5-4B MLP shapes
    python benchmarks/amx_gemm.py --rows 64 512 --rounds 20

Variants per shape and row count: float32 `torch.matmul` (the prompt path of `--weights fp32`),
bf16 `torch.matmul` through oneDNN capped below AMX (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`, what
the batch-invariant server allows oneDNN), bf16 through oneDNN with AMX (`--uncapped`: a
separate run, since oneDNN reads its cap once; batch-variant), and the AMX kernel at 1 and at
every kernel thread. Printed: best time of `--rounds` and GFLOP/s, and each variant against
float32. Needs a CPU with amx_tile and amx_bf16 for the AMX column (elsewhere it is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

SHAPES = {  # name: (out_features, in_features)
    "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "qwen3.5-4b gate_up": (18432, 2560), "qwen3.5-4b down": (2560, 9216),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--uncapped", action="store_true",
                   help="let oneDNN use AMX (its bf16 column then is AMX's, batch-variant)")
    p.add_argument("--out", default="benchmarks/results/amx_gemm.json")
    return p.parse_args()


def best_of(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each variant's best wall time over `rounds` rounds, the variants alternating."""
    best = {name: float("inf") for name in runs}
    for run in runs.values():
        run()  # warm: packing caches, oneDNN primitives, pool threads
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def variants(x, w, w_bf16, packed, threads: int) -> dict[str, Callable[[], object]]:
    from kvpark.kernels import amx_gemm

    x_bf16 = x.bfloat16()
    runs = {"fp32": lambda: x @ w.T, "bf16 oneDNN": lambda: x_bf16 @ w_bf16.T}
    if packed is not None:
        runs["amx 1 thread"] = lambda: amx_gemm.gemm(x, packed, num_threads=1)
        runs[f"amx {threads} threads"] = lambda: amx_gemm.gemm(x, packed)
    return runs


def main() -> None:
    args = parse_args()
    if not args.uncapped:  # before torch first asks oneDNN anything
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    import torch

    from kvpark.kernels import amx_gemm, worker_pool
    from kvpark.kernels.cores import usable_cores

    threads = usable_cores().count
    torch.set_num_threads(threads)
    worker_pool.set_num_threads(threads)
    amx = amx_gemm.usable()
    rows_out, table = [], []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k)
        w_bf16, packed = w.bfloat16(), amx_gemm.pack(w) if amx else None
        for m in args.rows:
            best = best_of(variants(torch.randn(m, k), w, w_bf16, packed, threads),
                           args.rounds)
            flops = 2 * m * n * k
            for name, seconds in best.items():
                rows_out.append({"shape": shape, "rows": m, "variant": name,
                                 "seconds": seconds, "gflops": flops / seconds / 1e9,
                                 "vs_fp32": best["fp32"] / seconds})
                table.append(f"| {shape} | {m} | {name} | {seconds * 1e3:.3f} | "
                             f"{flops / seconds / 1e9:.1f} | {best['fp32'] / seconds:.2f}x |")
    print(f"threads {threads}, AMX kernel {'on' if amx else 'off (not usable here)'}, oneDNN "
          f"cap {os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}")
    print("| shape | rows | variant | best ms | GFLOP/s | vs fp32 |\n|---|---|---|---|---|---|")
    print("\n".join(table))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": threads, "amx": amx, "results": rows_out,
                                          "onednn_cap": os.environ.get("ONEDNN_MAX_CPU_ISA")},
                                         indent=1))


if __name__ == "__main__":
    main()
