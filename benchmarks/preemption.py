"""The spec's three tables on this machine, with the default model, scaled to fit.

1. results: four concurrent streaming chats of ~1000-token prompts per cell of
   --preempt-ram (default / inside the park-size range / smaller / 0) x two pool sizes:
   completed, parks (swap / recompute), recomputed tokens, aggregate tok/s per run and median;
2. exactness: one request at a time with KVPARK_PREEMPT_EVERY against the same request without
   it, for a swap budget and for 0 (recompute): byte-identical, or the first divergent char;
3. cost when it does not fire: one chat, preemption on vs --no-preempt, tok/s and the ratio;
4. fairness: 8 chats on a pool that fits about 3, each request's longest park and p95, under
   the "fair" (head-of-line by park time) and "spec" restore orders;
5. watermarks: the results workload with --preempt-high/--preempt-low on (94/80) and off.

    python benchmarks/preemption.py --runs 3
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import re
import statistics
import time

from plotting import LATENCY_HEADERS, latency_cells, latency_summary, plot_latency
from workload import (
    ServerProcess,
    long_prompt,
    median,
    print_table,
    stream_chat,
    write_json,
)

MIB = 1 << 20


def first_divergence(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def results_cells(model: str, ctx: int, budget: str, args) -> list[dict]:
    """One cell per prefix-cache mode; the modes' runs alternate, so they share the machine."""
    cells = {cache: {"ctx": ctx, "budget": budget, "cache": cache, "runs": []}
             for cache in args.cache_modes}
    for _ in range(args.runs):
        for cache, cell in cells.items():
            cell["runs"].append(results_run(model, ctx, budget, cache, args))
    return list(cells.values())


def mean_ms(metrics: dict[str, float], histogram: str) -> float | None:
    count = metrics.get(f"{histogram}_count", 0)
    return metrics[f"{histogram}_sum"] / count * 1e3 if count else None


def results_run(model: str, ctx: int, budget: str, cache: str, args) -> dict:
    flag = "--prefix-cache" if cache == "on" else "--no-prefix-cache"
    with ServerProcess(["-np", "4", "-c", str(ctx), "--preempt-ram", budget, flag,
                        "--threads", str(args.threads), *args.server_flags], model=model
                       ) as server:
        prompts = [long_prompt(i, args.prompt_tokens) for i in range(4)]
        started = time.perf_counter()
        with cf.ThreadPoolExecutor(4) as pool:
            chats = list(pool.map(lambda p: stream_chat(server.url, p, args.max_tokens),
                                  prompts))
        wall = time.perf_counter() - started
        m = server.metrics()
    tokens = sum(c.completion_tokens for c in chats)
    run = {
        "completed": sum(c.ok and c.completion_tokens == args.max_tokens for c in chats),
        "errors": [c.error for c in chats if c.error],
        "ttft": [c.ttft for c in chats if c.ttft is not None],
        "itl": [g for c in chats for g in c.itl],
        "swap": int(m["kvpark:n_preempt_swap_total"]),
        "recompute": int(m["kvpark:n_preempt_recompute_total"]),
        # of those parks, the ones whose resume found every full page in the prefix cache
        "cached": int(m.get("kvpark:n_preempt_cached_total", 0)),
        "recomputed_tokens": int(m["kvpark:n_recompute_tokens_total"]),
        "tok_s": tokens / wall,
        # park sizes: a swap copies its pages and (a hybrid model) its state slot
        "page_bytes": int(m.get("kvpark:kv_cache_page_bytes", 0)),
        "state_bytes": int(m.get("kvpark:state_slot_bytes", 0)),
        "peak_host_bytes": int(m.get("kvpark:host_ram_peak_bytes", 0)),
        "swap_park_ms": mean_ms(m, "kvpark:preempt_park_seconds"),
        "swap_resume_ms": mean_ms(m, "kvpark:preempt_resume_seconds"),
        # speculative decoding (--server-flags "--spec-type ..."): drafts verified, accepted
        "draft_tokens": int(m.get("kvpark:spec_decode_num_draft_tokens_total", 0)),
        "accepted_tokens": int(m.get("kvpark:spec_decode_num_accepted_tokens_total", 0)),
    }
    shown = {k: v for k, v in run.items() if k not in ("ttft", "itl")}  # samples: JSON only
    print(f"  -c {ctx} --preempt-ram {budget} cache {cache}: {shown}", flush=True)
    return run


def exactness(model: str, args) -> list[dict]:
    prompts = [long_prompt(0, 200), long_prompt(3, 400)]
    rows = []
    with ServerProcess(["-np", "1", "-c", "4096", "--threads", str(args.threads),
                        *args.server_flags], model=model) as plain:
        reference = [stream_chat(plain.url, p, args.exact_tokens).text for p in prompts]
    for budget in ("8192", "0"):
        with ServerProcess(["-np", "1", "-c", "4096", "--preempt-ram", budget,
                            "--threads", str(args.threads), *args.server_flags], model=model,
                           env={"KVPARK_PREEMPT_EVERY": str(args.every)}) as server:
            got = [stream_chat(server.url, p, args.exact_tokens).text for p in prompts]
            parks = int(server.metric("kvpark:n_preempt_total"))
            mode = "swap" if budget != "0" else "recompute"
        for i, (ref, out) in enumerate(zip(reference, got)):
            where = first_divergence(ref, out)
            rows.append({"preempt_ram": budget, "prompt": i, "parks": parks, "mode": mode,
                         "reference_chars": len(ref), "got_chars": len(out),
                         "result": "byte-identical" if ref.encode() == out.encode()
                         else f"differs, first divergence at char {where}"})
    return rows


def cost_when_idle(model: str, args) -> list[dict]:
    rows = []
    prompt = long_prompt(1, args.prompt_tokens)
    for _ in range(2):
        for flag in ("--preempt", "--no-preempt"):
            with ServerProcess(["-np", "4", "-c", "8192", flag, "--threads", str(args.threads)],
                               model=model) as server:
                chat = stream_chat(server.url, prompt, args.max_tokens)
            rows.append({"flag": flag, "tok_s": chat.completion_tokens / chat.seconds,
                         "text": chat.text})
    return rows


RESUMED = re.compile(r"seq (\S+) \(slot \d+\) resumed after ([\d.]+) ms")


def longest_parks(log: str) -> dict[str, float]:
    """Each request's longest single park in seconds, from the server's 'resumed after' lines."""
    longest: dict[str, float] = {}
    for request_id, ms in RESUMED.findall(log):
        longest[request_id] = max(longest.get(request_id, 0.0), float(ms) / 1e3)
    return longest


def p95(values: list[float]) -> float:
    if len(values) < 2:
        return max(values, default=0.0)
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def fairness(args) -> list[dict]:
    runs: dict[str, list[dict]] = {"fair": [], "spec": []}
    for _ in range(args.fair_runs):
        for order in runs:  # alternate, so both orders see the same machine
            runs[order].append(fairness_run(args, order))
    rows = []
    for order, results in runs.items():
        rows.append({"order": order, "runs": results,
                     "completed": sum(r["completed"] for r in results),
                     "parks": sum(r["parks"] for r in results),
                     "max_s": median([r["max_s"] for r in results]),
                     "p95_s": median([r["p95_s"] for r in results]),
                     "mean_s": median([r["mean_s"] for r in results])})
    return rows


def fairness_run(args, order: str) -> dict:
    with ServerProcess(["-np", "8", "-c", str(args.fair_ctx), "--preempt-resume", order,
                        "--threads", str(args.threads)], model=args.fair_model) as server:
        prompts = [long_prompt(i, args.fair_prompt_tokens) for i in range(8)]
        with cf.ThreadPoolExecutor(8) as pool:
            chats = list(pool.map(lambda p: stream_chat(server.url, p, args.fair_tokens),
                                  prompts))
        parks = longest_parks(server.log())
        m = server.metrics()
    waits = list(parks.values()) + [0.0] * (8 - len(parks))
    row = {"order": order, "completed": sum(c.ok for c in chats),
           "parks": int(m["kvpark:n_preempt_total"]), "max_s": max(waits),
           "p95_s": p95(waits), "mean_s": statistics.mean(waits)}
    print(f"  fairness {order}: {row}", flush=True)
    return row


def watermarks(args) -> list[dict]:
    rows = []
    for label, flags in (("on (94/80)", []),
                         ("off", ["--preempt-high", "100", "--preempt-low", "100"])):
        with ServerProcess(["-np", "4", "-c", str(args.pools[0]), "--threads",
                            str(args.threads), *flags], model=args.model) as server:
            prompts = [long_prompt(i, args.prompt_tokens) for i in range(4)]
            started = time.perf_counter()
            with cf.ThreadPoolExecutor(4) as pool:
                chats = list(pool.map(lambda p: stream_chat(server.url, p, args.max_tokens),
                                      prompts))
            wall = time.perf_counter() - started
            m = server.metrics()
        rows.append({"watermarks": label, "completed": sum(c.ok for c in chats),
                     "parks": int(m["kvpark:n_preempt_total"]),
                     "early_parks": int(m["kvpark:n_preempt_watermark_total"]),
                     "refused_restores": int(m["kvpark:n_restore_refused_watermark_total"]),
                     "latency": latency_summary([c.ttft for c in chats if c.ttft is not None],
                                                [g for c in chats for g in c.itl]),
                     "tok_s": sum(c.completion_tokens for c in chats) / wall})
        print(f"  watermarks {label}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--pools", type=int, nargs=2, default=[3072, 4096])
    # SmolLM2 in fp32 parks 720 KiB per 16-token page: a ~1000-token chat is ~45 MiB
    p.add_argument("--budgets", nargs="+", default=["8192", "64", "16", "0"])
    p.add_argument("--cache-modes", nargs="+", choices=["on", "off"], default=["on", "off"],
                   help="run the results table with the prefix cache on, off, or both")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--exact-tokens", type=int, default=300)
    p.add_argument("--tables", nargs="+",
                   default=["results", "exactness", "cost", "fairness", "watermarks"])
    p.add_argument("--fair-model", default="synthetic:tiny")
    p.add_argument("--fair-ctx", type=int, default=5120)
    p.add_argument("--fair-prompt-tokens", type=int, default=200)
    p.add_argument("--fair-tokens", type=int, default=1500)
    p.add_argument("--fair-runs", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/preemption.json")
    p.add_argument("--server-flags", default="", type=str.split,
                   help='more kvpark flags for the tables\' servers, e.g. "--spec-type draft-mtp '
                   '--spec-draft-n-max 2" (the design\'s configuration)')
    args = p.parse_args()
    report: dict = {"args": vars(args)}

    if "results" in args.tables:
        cells = [cell for ctx in args.pools for budget in args.budgets
                 for cell in results_cells(args.model, ctx, budget, args)]
        report["results"] = cells
        rows, series = [], {}
        for cell in cells:
            runs = cell["runs"]
            name = f"{cell['budget']} MiB, -c {cell['ctx']}, cache {cell['cache']}"
            series[name] = ([t for r in runs for t in r["ttft"]],
                            [t for r in runs for t in r["itl"]])
            cell["latency"] = latency_summary(*series[name])
            rows.append([cell["budget"] + " MiB", cell["ctx"], cell["cache"],
                         f"{sum(r['completed'] for r in runs)} of {4 * len(runs)}",
                         ", ".join(f"{r['swap'] + r['recompute']} ({r['swap']}/{r['recompute']}"
                                   f"/{r['cached']})" for r in runs),
                         ", ".join(str(r["recomputed_tokens"]) for r in runs),
                         ", ".join(f"{r['tok_s']:.1f}" for r in runs),
                         f"{median([r['tok_s'] for r in runs]):.1f}",
                         *latency_cells(cell["latency"])])
        print(f"\n4 concurrent streaming chats, ~{args.prompt_tokens}-token prompts, "
              f"{args.max_tokens} generated each, temperature 0")
        print_table(["--preempt-ram", "-c", "prefix cache", "completed",
                     "parks (swap/recompute/cached of them)", "recomputed tokens",
                     "aggregate tok/s", "median", *LATENCY_HEADERS], rows)
        plot_latency(args.out, series, "preemption results: --preempt-ram x pool x cache")
    if "exactness" in args.tables:
        report["exactness"] = exactness(args.model, args)
        print(f"\nexactness: one request at a time, KVPARK_PREEMPT_EVERY={args.every}")
        print_table(["--preempt-ram", "prompt", "parks", "mode", "reference chars", "got",
                     "result"],
                    [[r["preempt_ram"], r["prompt"], r["parks"], r["mode"],
                      r["reference_chars"], r["got_chars"], r["result"]]
                     for r in report["exactness"]])
    if "cost" in args.tables:
        rows = cost_when_idle(args.model, args)
        report["cost"] = rows
        on = median([r["tok_s"] for r in rows if r["flag"] == "--preempt"])
        off = median([r["tok_s"] for r in rows if r["flag"] == "--no-preempt"])
        same = len({r["text"] for r in rows}) == 1
        print("\ncost when it does not fire: one chat, two runs each, alternating")
        print_table(["--preempt tok/s", "--no-preempt tok/s", "ratio", "output"],
                    [[", ".join(f"{r['tok_s']:.1f}" for r in rows if r["flag"] == "--preempt"),
                      ", ".join(f"{r['tok_s']:.1f}" for r in rows
                                if r["flag"] == "--no-preempt"),
                      f"{on / off:.2f}x", "byte-identical" if same else "differs"]])
    if "fairness" in args.tables:
        rows = fairness(args)
        report["fairness"] = rows
        print(f"\nfairness: 8 chats on -c {args.fair_ctx} ({args.fair_model}), longest park "
              f"per request, median over {args.fair_runs} alternating runs")
        print_table(["resume order", "completed", "parks", "max parked s", "p95 parked s",
                     "mean parked s"],
                    [[r["order"], f"{r['completed']} of {8 * args.fair_runs}", r["parks"],
                      f"{r['max_s']:.2f}",
                      f"{r['p95_s']:.2f}", f"{r['mean_s']:.2f}"] for r in rows])
    if "watermarks" in args.tables:
        rows = watermarks(args)
        report["watermarks"] = rows
        print(f"\nwatermarks: the results workload at -c {args.pools[0]}")
        print_table(["watermarks", "completed", "parks", "early parks", "refused restores",
                     "tok/s", *LATENCY_HEADERS],
                    [[r["watermarks"], f"{r['completed']} of 4", r["parks"], r["early_parks"],
                      r["refused_restores"], f"{r['tok_s']:.1f}", *latency_cells(r["latency"])]
                     for r in rows])
    write_json(args.out, report)


if __name__ == "__main__":
    main()
