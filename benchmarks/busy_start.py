"""A server started while the machine is busy, against one started on a quiet machine (issue 41).

    python benchmarks/busy_start.py [--model builtin://smollm2-135m] [--concurrency 1 4]

Two kvpark servers with their defaults (`--threads 0 --kernel-threads 0`: start-up
measurements choose the threads): `quiet start` starts on an idle machine; `busy start` starts
while one CPU burner a core keeps every core busy, the burners stopping once it answers
/health. Then both are measured idle, rounds alternating between them (N streams of
~--prompt-tokens prompts, --max-tokens each, greedy), so the ratio says what a busy start costs
for the server's life. Each server's chosen threads are read from its log. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time

from throughput import run_round
from vs_vllm import Launched, kvpark, wait_until_quiet
from workload import median, print_table, write_json

THREADS_LINE = re.compile(r"threads: (\d+) torch \(prompt GEMMs\), (\d+) C kernel")


def burn(stop: multiprocessing.synchronize.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def start_busy(server: Launched) -> None:
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=burn, args=(stop,), daemon=True)
               for _ in range(os.cpu_count() or 1)]
    for burner in burners:
        burner.start()
    try:
        server.start()
    finally:
        stop.set()
        for burner in burners:
            burner.join()


def chosen_threads(server: Launched) -> str:
    found = THREADS_LINE.search(server.log())
    return f"{found.group(1)} torch / {found.group(2)} kernel" if found else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--flags", default="-np 4 -c 8192", help="both servers' flags")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=330)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--base-port", type=int, default=8400)
    p.add_argument("--out", default="benchmarks/results/busy_start.json")
    args = p.parse_args()

    quiet = kvpark("quiet start", args.model, args.base_port, args.flags.split())
    busy = kvpark("busy start", args.model, args.base_port + 1, args.flags.split())
    servers = [quiet, busy]
    try:
        quiet.start()
        start_busy(busy)
        threads = {s.name: chosen_threads(s) for s in servers}
        measured: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for concurrency in args.concurrency:
                for server in servers if r % 2 == 0 else servers[::-1]:
                    wait_until_quiet()
                    run = run_round(server.url, concurrency, args.prompt_tokens,
                                    args.max_tokens, f"{server.name} {r} {concurrency}")
                    measured.setdefault((server.name, concurrency), []).append(run)
                    print(f"{server.name} x{concurrency} round {r}: {run['tok_s']:.1f} tok/s",
                          flush=True)
    finally:
        for server in servers:
            server.stop()
    rows = []
    for concurrency in args.concurrency:
        base = median([run["tok_s"] for run in measured[quiet.name, concurrency]])
        for server in servers:
            runs = measured[server.name, concurrency]
            tok_s = median([run["tok_s"] for run in runs])
            ttft = median([t for run in runs for t in run["ttft"]])
            rows.append([server.name, concurrency, threads[server.name],
                         " / ".join(f"{run['tok_s']:.1f}" for run in runs), f"{tok_s:.1f}",
                         f"{tok_s / base:.2f}", f"{ttft:.2f}"])
    print_table(["server", "streams", "threads chosen", "tok/s by round", "median",
                 "vs quiet start", "TTFT p50 s"], rows)
    write_json(args.out, {"threads": threads, "runs": {f"{name} x{c}": runs for (name, c), runs
                                                       in measured.items()},
                          "argv": sys.argv, "time": time.time()})


if __name__ == "__main__":
    main()
