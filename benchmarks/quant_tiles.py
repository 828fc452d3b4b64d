"""Decode rows from blocks: quant_linear.c's row kernel against the tiles kernel's paths
(csrc/quant_tiles.c: AVX-512 vectors, AMX int8 tiles, and what the server calls), in
alternating rounds in one process, so the ratios hold on a shared machine (issue 41).

    python benchmarks/quant_tiles.py                    # SmolLM2-135M and Qwen3.5-4B shapes
    python benchmarks/quant_tiles.py --rows 1 32 --threads 1 --rounds 20

Random blocks of each shape (Q4_1 for SmolLM2's layers, Q8_0 for its tied lm_head and for
Qwen3.5-4B's linears, as blocks made at load give them); printed: the best time of `--rounds`
per variant and each tiles path against the row kernel. The AMX column needs amx_tile and
amx_int8 (and the OS's permission), the vector column AVX-512 VNNI; elsewhere they are skipped.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from amx_gemm import best_of

from kvpark.kernels import quant_linear as ql
from kvpark.kernels import worker_pool
from kvpark.kernels.quant_linear import QuantizedWeight, TilePath

SHAPES = {  # name: (kind, out_features, in_features)
    "smollm2 qkv": ("Q4_1", 960, 576), "smollm2 o": ("Q4_1", 576, 576),
    "smollm2 gate_up": ("Q4_1", 3072, 576), "smollm2 down": ("Q4_1", 576, 1536),
    "smollm2 lm_head": ("Q8_0", 49152, 576),
    "qwen3.5-4b gate_up": ("Q8_0", 18432, 2560), "qwen3.5-4b down": ("Q8_0", 2560, 9216),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2, help="kernel threads")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default="benchmarks/results/quant_tiles.json")
    return p.parse_args()


def random_blocks(kind: str, out_features: int, in_features: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(0)
    nb = in_features // ql.BLOCK
    scale = torch.rand(out_features, nb, generator=g) * 0.02
    if kind == "Q4_1":
        return QuantizedWeight(kind, scale, -torch.rand(out_features, nb, generator=g) * 0.1,
                               torch.randint(0, 256, (out_features, nb, 16), generator=g,
                                             dtype=torch.uint8))
    return QuantizedWeight(kind, scale, None, torch.randint(-128, 128, (out_features, nb, 32),
                                                            generator=g, dtype=torch.int8))


def variants(x: torch.Tensor, rows_layout: QuantizedWeight,
             tiles: QuantizedWeight) -> dict[str, Callable[[], object]]:
    runs: dict[str, Callable[[], object]] = {"rows": lambda: ql.quant_linear(x, rows_layout)}
    for name, path in (("vector", TilePath.VECTOR), ("amx", TilePath.AMX)):
        if ql.tile_path_runs(path):
            runs[name] = lambda path=path: ql.quant_tiles(x, tiles, path)
    runs["tiles auto"] = lambda: ql.quant_linear(x, tiles)
    return runs


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    worker_pool.set_num_threads(args.threads)
    results = []
    header = f"{'shape':20} {'rows':>4} " + " ".join(f"{n:>11}" for n in
                                                     ("rows us", "vector", "amx", "auto"))
    print(header + "   rows/vector rows/amx rows/auto")
    for shape in args.shapes:
        kind, out_features, in_features = SHAPES[shape]
        rows_layout = random_blocks(kind, out_features, in_features)
        tiles = rows_layout.tiled()
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            best = {k: v * 1e6 for k, v in best_of(variants(x, rows_layout, tiles),
                                                   args.rounds).items()}
            cells = [best.get(k) for k in ("rows", "vector", "amx", "tiles auto")]
            ratios = [best["rows"] / c if c else None for c in cells[1:]]
            print(f"{shape:20} {rows:4} " + " ".join(
                f"{c:11.1f}" if c else f"{'-':>11}" for c in cells) + "   " + " ".join(
                f"{r:8.2f}" if r else f"{'-':>8}" for r in ratios))
            results.append({"shape": shape, "kind": kind, "rows": rows, "us": best})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "rounds": args.rounds,
                                          "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
