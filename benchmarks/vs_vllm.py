"""kvpark against vLLM's CPU build, side by side on one machine (issue 30).

    python benchmarks/vs_vllm.py --hf-dir /tmp/smol-hf --vllm-python /tmp/vllm-venv/bin/python

Nothing is installed into kvpark's venv: vLLM runs from its own (`--vllm-python`; how to make it
and the Hugging Face directory from the builtin GGUF: benchmarks/README.md). Every server is
started here with its own defaults plus the flags below, all of them up at once, and the rounds
alternate between them, so a change in the machine's load hits every server alike:

- `kvpark`: the default model (the builtin GGUF), `-np 32 -c 16384`;
- `kvpark-hf`: the same weights as the bf16 Hugging Face directory vLLM serves;
- `vllm rN`: vLLM on that directory, `--dtype bfloat16 --max-num-seqs 32`, with
  `VLLM_CPU_NUM_OF_RESERVED_CPU=N` (its default reserves one core for its scheduler; 0 gives
  the model every core): one target per `--vllm-reserved` value.

Streams: N chats at once with ~--prompt-tokens prompts and --max-tokens generated (EOS ignored,
greedy), each round's prompts unique to it (no prefix-cache hits across rounds); a lone
prompt's prefill speed before each. Pressure (`--pressure-rounds`, then every server restarted
with a ~4096-token pool and 4 slots): 4 chats of ~1000-token prompts and 600 tokens at once,
so their KV cannot all fit; kvpark parks (swap or recompute), vLLM preempts by recompute.

Prints one table per phase (each round's aggregate tok/s, the median, the ratio to the best
vLLM target, TTFT and ITL percentiles) and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from plotting import LATENCY_HEADERS, latency_cells, latency_summary
from throughput import measure_prefill, run_round
from workload import (
    ServerProcess,
    long_prompt,
    median,
    print_table,
    stream_chat,
    write_json,
)

START_TIMEOUT = 900  # vLLM's first start compiles its CPU kernels' graphs
QUIET_BUSY = 0.10  # a round starts once the machine's cores are this busy at most ...
QUIET_WINDOW_S = 0.5  # ... over this window
QUIET_MAX_WAIT_S = 30.0


@dataclass
class Launched(ServerProcess):
    """A server from its own command line, in this process's environment plus `env`: none of
    the tests' pins (one torch thread), so each server runs with its own defaults."""

    name: str = ""
    cmd: list[str] = field(default_factory=list)
    start_timeout: float = START_TIMEOUT

    def command(self) -> list[str]:
        return self.cmd

    def environment(self) -> dict[str, str]:
        return {**os.environ, **self.env}


def kvpark(name: str, model: str, port: int, flags: list[str]) -> Launched:
    return Launched([], port=port, name=name, cmd=[
        sys.executable, "-m", "kvpark.pod", "--host", "127.0.0.1", "--port", str(port),
        "-m", model, *flags])


def vllm(name: str, python: str, hf_dir: str, port: int, reserved: int,
         flags: list[str]) -> Launched:
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}
    return Launched([], env=env, port=port, name=name, cmd=[
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
        "--served-model-name", "default", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", *flags])


def start_all(servers: list[Launched]) -> None:
    """One at a time: two starts at once would measure each other's start-up."""
    for server in servers:
        server.start()
        print(f"{server.name} ready at {server.url} (log {server.log_path})", flush=True)


def cpu_busy_share(window: float) -> float:
    """The share of all cores' time spent busy over `window` seconds (/proc/stat)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = sample()
    time.sleep(window)
    busy1, total1 = sample()
    return (busy1 - busy0) / max(1, total1 - total0)


def wait_until_quiet() -> float:
    """Seconds waited for the machine to go quiet before a round: a server that just finished
    may keep its threads spinning a while, and the next server's round must not share the
    cores with that."""
    started = time.monotonic()
    while time.monotonic() - started < QUIET_MAX_WAIT_S:
        if cpu_busy_share(QUIET_WINDOW_S) <= QUIET_BUSY:
            break
    return time.monotonic() - started


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """A metric's samples added up over their labels (vLLM labels each with engine and model)."""
    return sum(v for key, v in metrics.items() if key.partition("{")[0] == name)


def preemptions(server: Launched) -> dict[str, float]:
    m = server.metrics()
    return {"swap": metric_sum(m, "kvpark:n_preempt_swap_total"),
            "recompute": metric_sum(m, "kvpark:n_preempt_recompute_total"),
            "vllm": metric_sum(m, "vllm:num_preemptions_total")}


def pressure_round(server: Launched, chats: int, prompt_tokens: int, max_tokens: int,
                   salt: str) -> dict:
    before = preemptions(server)
    prompts = [long_prompt(i, prompt_tokens, salt) for i in range(chats)]
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(chats) as pool:
        results = list(pool.map(lambda p: stream_chat(server.url, p, max_tokens), prompts))
    wall = time.perf_counter() - started
    after = preemptions(server)
    tokens = sum(r.completion_tokens for r in results)
    return {"concurrency": chats, "completed": sum(r.ok and r.completion_tokens == max_tokens
                                                   for r in results),
            "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "errors": [r.error for r in results if r.error],
            "parks": {k: after[k] - before[k] for k in after},
            "ttft": [r.ttft for r in results if r.ttft is not None],
            "itl": [gap for r in results for gap in r.itl]}


def cell_row(name: str, runs: list[dict], best_vllm: float | None) -> list[object]:
    lat = latency_summary([t for r in runs for t in r["ttft"]],
                          [t for r in runs for t in r["itl"]])
    rates = [r["tok_s"] for r in runs]
    ratio = f"{median(rates) / best_vllm:.2f}x" if best_vllm else "-"
    done = sum(r["completed"] for r in runs)
    return [name, f"{done}/{sum(r['concurrency'] for r in runs)}",
            f"{median(rates):.1f} ({', '.join(f'{x:.1f}' for x in rates)})", ratio,
            *latency_cells(lat)]


HEADERS = ["server", "completed", "tok/s median (rounds)", "vs best vLLM", *LATENCY_HEADERS]


def print_cells(title: str, measured: dict[tuple[str, int], list[dict]],
                names: list[str], cells: list[int]) -> None:
    for cell in cells:
        vllm_rates = [median([r["tok_s"] for r in measured[(n, cell)]])
                      for n in names if n.startswith("vllm")]
        best = max(vllm_rates, default=None)
        print(f"\n{title} {cell}")
        print_table(HEADERS, [cell_row(n, measured[(n, cell)], best) for n in names])


def kvpark_servers(args: argparse.Namespace, ports: Iterator[int], pool: list[str]
                   ) -> list[Launched]:
    """kvpark at its defaults, on the bf16 directory (unless --no-hf), and each --variant."""
    servers = [kvpark("kvpark", args.model, next(ports), pool)]
    if args.hf:
        servers.append(kvpark("kvpark-hf", args.hf_dir, next(ports), pool))
    for variant in args.variant:
        name, _, flags = variant.partition("=")
        servers.append(kvpark(name, args.model, next(ports), [*pool, *flags.split()]))
    return servers


def streams_phase(args: argparse.Namespace, ports: Iterator[int]) -> dict:
    servers = kvpark_servers(args, ports, ["-np", "32", "-c", "16384"])
    servers += [vllm(f"vllm r{n}", args.vllm_python, args.hf_dir, next(ports), n,
                     ["--max-num-seqs", "32", "--max-model-len", "4096"])
                for n in args.vllm_reserved]
    measured: dict[tuple[str, int], list[dict]] = {}
    try:
        start_all(servers)
        for round_no in range(args.rounds):
            for concurrency in args.concurrency:
                for server in servers:
                    quiet_after = wait_until_quiet()
                    salt = f"{round_no}.{concurrency}"
                    prefill = measure_prefill(server.url, args.prompt_tokens,
                                              f"{server.name} {salt}")
                    result = run_round(server.url, concurrency, args.prompt_tokens,
                                       args.max_tokens, salt=salt)
                    result["prefill"], result["quiet_after_s"] = prefill, quiet_after
                    measured.setdefault((server.name, concurrency), []).append(result)
                    print(f"{server.name} x{concurrency}: {result['tok_s']:.1f} tok/s "
                          f"({result['completed']}/{concurrency}); prefill "
                          f"{prefill['tok_s']:.0f} tok/s; {quiet_after:.1f} s to quiet before",
                          flush=True)
    finally:
        for server in servers:
            server.stop()
    print_cells("streams:", measured, [s.name for s in servers], args.concurrency)
    return {f"{k[0]} x{k[1]}": v for k, v in measured.items()}


def pressure_phase(args: argparse.Namespace, ports: Iterator[int]) -> dict:
    servers = kvpark_servers(args, ports, ["-np", "4", "-c", "4096"])
    # vLLM's CPU KV blocks hold 128 tokens: 32 of them are the same ~4096-token pool (it keeps
    # one back, and refuses to start unless one request of --max-model-len fits in the rest)
    servers += [vllm(f"vllm r{n}", args.vllm_python, args.hf_dir, next(ports), n,
                     ["--max-num-seqs", "4", "--max-model-len", "2048",
                      "--num-gpu-blocks-override", "32"])
                for n in args.vllm_reserved]
    measured: dict[tuple[str, int], list[dict]] = {}
    try:
        start_all(servers)
        for round_no in range(args.pressure_rounds):
            for server in servers:
                quiet_after = wait_until_quiet()
                result = pressure_round(server, 4, 1000, 600, salt=f"pressure {round_no}")
                result["quiet_after_s"] = quiet_after
                measured.setdefault((server.name, 4), []).append(result)
                print(f"{server.name} pressure: {result['tok_s']:.1f} tok/s "
                      f"({result['completed']}/4), parks {result['parks']}; {quiet_after:.1f} s "
                      "to quiet before", flush=True)
    finally:
        for server in servers:
            server.stop()
    print_cells("pressure: 4 chats, ~1000-token prompts, 600 tokens, ~4096-token pool, x",
                measured, [s.name for s in servers], [4])
    for name in [s.name for s in servers]:
        parks = [r["parks"] for r in measured[(name, 4)]]
        print(f"{name}: parks/preemptions per round {parks}")
    return {f"{k[0]} pressure": v for k, v in measured.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", required=True, help="the bf16 HF directory both servers load")
    p.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    p.add_argument("--model", default="builtin://smollm2-135m", help="kvpark's own model")
    p.add_argument("--vllm-reserved", type=int, nargs="+", default=[0],
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU values, one vLLM target each")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also kvpark on the bf16 directory vLLM serves")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="one more kvpark on its own model with these flags, e.g. "
                   "'kvpark amx-off=--amx off' (repeatable)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 32])
    p.add_argument("--prompt-tokens", type=int, default=330)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pressure-rounds", type=int, default=2)
    p.add_argument("--base-port", type=int, default=8300)
    p.add_argument("--out", default="benchmarks/results/vs_vllm.json")
    args = p.parse_args()
    ports = iter(range(args.base_port, args.base_port + 100))
    results = {"args": vars(args), "load_at_start": os.getloadavg()}
    if args.concurrency and args.rounds:
        results["streams"] = streams_phase(args, ports)
        write_json(args.out, results)  # kept should the next phase fail
    if args.pressure_rounds:
        results["pressure"] = pressure_phase(args, ports)
        write_json(args.out, results)


if __name__ == "__main__":
    main()
