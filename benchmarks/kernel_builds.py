"""The C kernels of two source trees against each other in one process: a decoder layer's
prompt-row GEMMs on AMX tiles and its prompt rows' attention (issue 41).

    python benchmarks/kernel_builds.py --base HEAD~2        # this checkout against a commit
    python benchmarks/kernel_builds.py --base main --rows 512 --rounds 60 --threads 1 2

The base is `kernels/csrc` of a git revision (`git archive`), built into the usual cache
beside this checkout's; both libraries are loaded at once. Each round runs every case once per
build, back to back in an order that alternates round to round, so a shared machine's slow
minutes hit both; a case's ratio is the median of the per-round ratios (this checkout / base).
The outputs of the two builds are compared bit for bit (a kernel change meant to keep the bits
must print `same`). Shapes default to SmolLM2-135M's; needs AMX (exits 2 elsewhere).
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpark.kernels import amx_gemm, cbuild, cpu_paged

PAGE = 16


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[ctypes.CDLL], torch.Tensor]  # one call of this build; its output


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision whose kernels/csrc is the base")
    p.add_argument("--rows", type=int, nargs="+", default=[512], help="prompt rows a step")
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64],
                   metavar=("Q", "KV", "DIM"), help="attention heads and head dim")
    p.add_argument("--prompts", type=int, nargs="+", default=[330, 1024],
                   help="prompt lengths for the attention cases")
    p.add_argument("--out", default="benchmarks/results/kernel_builds.json")
    return p.parse_args()


def base_sources(revision: str, into: Path) -> list[Path]:
    """kernels/csrc of `revision`, extracted under `into`; its .c files in build order."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", revision, "kernels/csrc"], cwd=root,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    csrc = into / "kernels" / "csrc"
    return [csrc / s.name for s in cbuild.SOURCES if (csrc / s.name).exists()]


def load(sources: list[Path]) -> ctypes.CDLL:
    """A build of `sources` with the C signatures this checkout declares for the GEMM and the
    prompt attention's float32 entry (the entries both builds have)."""
    lib = amx_gemm.declare(ctypes.CDLL(str(cbuild.build(sources))))
    ours = cpu_paged.load_kernel().kvpark_amx_prompt_attention
    lib.kvpark_amx_prompt_attention.argtypes = ours.argtypes
    lib.kvpark_amx_prompt_attention.restype = ours.restype
    return lib


def gemm_cases(args: argparse.Namespace, rows: int, threads: int) -> list[Case]:
    """The layer's four GEMMs as the server calls them: qkv; o and down with the residual;
    gate and up with SwiGLU into float32 rows and into the down GEMM's A tiles."""
    h, i = args.hidden, args.intermediate
    q, kv, d = args.heads
    shapes = [("qkv", (q + 2 * kv) * d, h, "plain"), ("o", h, q * d, "residual"),
              ("gate_up", 2 * i, h, "silu"), ("gate_up tiles", 2 * i, h, "silu tiles"),
              ("down", h, i, "residual")]
    cases = []
    for name, n, k, kind in shapes:
        x, packed = torch.randn(rows, k), amx_gemm.pack(torch.randn(n, k) * 0.05)
        residual = torch.randn(rows, n) if kind == "residual" else None
        out_cols = n // 2 if kind.startswith("silu") else n

        def run(lib, x=x, packed=packed, residual=residual, n=n, k=k, kind=kind,
                out_cols=out_cols):
            tiles = kind == "silu tiles"
            out = (torch.zeros(amx_gemm.ATiles.empty(rows, out_cols).data.numel(),
                               dtype=torch.int16) if tiles else torch.empty(rows, out_cols))
            done = lib.kvpark_amx_gemm(
                x.data_ptr(), None, rows, k, packed.data.data_ptr(), n,
                None if residual is None else residual.data_ptr(),
                None if tiles else out.data_ptr(), out.data_ptr() if tiles else None,
                int(kind.startswith("silu")), threads, 0)
            assert done == 0, f"kvpark_amx_gemm: {done}"
            return out
        cases.append(Case(f"{name} {rows}x{k}->{n} k{threads}", run))
    return cases


def attention_cases(args: argparse.Namespace, threads: int) -> list[Case]:
    """One prompt of each length through one layer's prompt-row attention (a bf16 pool)."""
    q_heads, kv_heads, d = args.heads
    cases = []
    for length in args.prompts:
        pages = -(-length // PAGE)
        cache = torch.randn(pages, 2, PAGE, kv_heads, d).bfloat16()
        q = torch.randn(length, q_heads, d)
        plan = [torch.tensor(v, dtype=torch.int32) for v in
                ([0, length], [length], [length], [0, pages], list(range(pages)))]

        def run(lib, q=q, cache=cache, plan=plan, length=length):
            out = torch.empty(length, q_heads, d)
            qo, prompt, kv_lens, kv_indptr, kv_indices = (t.data_ptr() for t in plan)
            done = lib.kvpark_amx_prompt_attention(
                q.data_ptr(), q.stride(0), q.stride(1), cache.data_ptr(), 1, out.data_ptr(), 1,
                qo, prompt, kv_lens, kv_indptr, kv_indices, q_heads, kv_heads, d, PAGE,
                d ** -0.5, threads)
            assert done == 0, f"kvpark_amx_prompt_attention: {done}"
            return out
        cases.append(Case(f"attention {length} tokens k{threads}", run))
    return cases


def measure(cases: list[Case], libs: dict[str, ctypes.CDLL], rounds: int) -> list[dict]:
    times = {(c.name, b): [] for c in cases for b in libs}
    outs: dict[tuple[str, str], torch.Tensor] = {}
    for case in cases:  # warm: page faults, pool threads, tile permission
        for build, lib in libs.items():
            outs[case.name, build] = case.run(lib)
    for r in range(rounds):
        order = list(libs) if r % 2 == 0 else list(libs)[::-1]
        for case in cases:
            for build in order:
                started = time.perf_counter()
                outs[case.name, build] = case.run(libs[build])
                times[case.name, build].append(time.perf_counter() - started)
    rows = []
    for case in cases:
        base, new = times[case.name, "base"], times[case.name, "this"]
        same = torch.equal(outs[case.name, "base"].view(torch.int16),
                           outs[case.name, "this"].view(torch.int16))
        rows.append({"case": case.name, "base_best_ms": min(base) * 1e3,
                     "this_best_ms": min(new) * 1e3,
                     "ratio": statistics.median(n / b for n, b in zip(new, base)),
                     "this_faster_rounds": sum(n < b for n, b in zip(new, base)),
                     "bits": "same" if same else "differ"})
    return rows


def main() -> None:
    args = parse_args()
    if not amx_gemm.usable():
        print("AMX is not usable here: nothing to compare", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": load(base_sources(args.base, Path(tmp))),
                "this": load(list(cbuild.SOURCES))}
    torch.manual_seed(0)
    cases = [c for t in args.threads for rows in args.rows for c in gemm_cases(args, rows, t)]
    cases += [c for t in args.threads for c in attention_cases(args, t)]
    rows = measure(cases, libs, args.rounds)
    print(f"this checkout against {args.base}, {args.rounds} rounds, builds alternating")
    print("| case | base best ms | this best ms | this / base (median of rounds) "
          "| this faster | bits |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['base_best_ms']:.3f} | {r['this_best_ms']:.3f} "
              f"| {r['ratio']:.3f} | {r['this_faster_rounds']}/{args.rounds} | {r['bits']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
