"""The prefix cache's disk tier across a restart (issue 42): TTFT of the turn after it.

    python benchmarks/disk_restart.py
    python benchmarks/disk_restart.py -C 8 -T 4 --restart-after 2 --variants a b c
    python benchmarks/disk_restart.py --launch "-np 4 -c 8192" --disk-gib 2 --write-out 20

C concurrent conversations x T turns, each turn re-sending the whole history (chat completions,
streamed, seeded, temperature 0, `--max-tokens` per answer with ignore_eos); within a turn all C
requests run at once, then the next turn. Four variants, each with fresh servers launched with
the same `--launch` flags and, where the disk is on, `--cache-disk` on a fresh folder of its own:

    a  disk on: after turn --restart-after the server gets SIGTERM (it drains, writes the pages
       the disk lacks and exits; we wait for the exit), a new one starts on the same folder and
       the conversations go on
    b  disk off, the same restart
    c  disk on, no restart: the same turn without a restart
    d  two servers sharing one folder from the start, turns alternating (turn 1 on A, 2 on B, ..)

The variants alternate turn by turn (a, b, c, d), so they see the same machine conditions; the
restarts of a and b happen between the same two turns, while c and d wait. Printed: per variant
and turn the median and p95 TTFT, prompt and cached tokens (`cached_tokens`: any tier), the
cached share, and the turn's server's disk pages read back, written and dropped (queue full)
over the turn (`kvpark:disk_cache_{hits,writes,dropped}_total`); each restart's SIGTERM-to-exit
time and the page files left on disk; then the turn after the restart in a and b against c
(target for a: within 1.5x) and d's cached share per turn. The JSON (`--out`) keeps every
request's TTFT, prompt and cached tokens, each turn's disk counters and each server's log path.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import random
import shlex
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from multiturn import Conversation, chat_turn, new_words
from plotting import percentile
from workload import ServerProcess, print_table, write_json

TARGET = 1.5  # issue 42: the turn after a restart within 1.5x of the same turn without one
DISK_METRICS = ("kvpark:disk_cache_hits_total", "kvpark:disk_cache_writes_total",
                "kvpark:disk_cache_dropped_total", "kvpark:disk_cache_lookups_total",
                "kvpark:disk_cache_rejected_total", "kvpark:disk_cache_bytes")
COUNTED = {"disk_hits": DISK_METRICS[0], "disk_writes": DISK_METRICS[1],
           "disk_dropped": DISK_METRICS[2]}  # per turn: the turn's server's counters


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    disk: bool
    restart: bool
    servers: int = 1


VARIANTS = {v.key: v for v in (
    Variant("a", "disk, restart", disk=True, restart=True),
    Variant("b", "no disk, restart", disk=False, restart=True),
    Variant("c", "disk, no restart", disk=True, restart=False),
    Variant("d", "2 servers, 1 disk", disk=True, restart=False, servers=2))}


@dataclass
class Run:
    """One variant: its servers (the live ones), conversations and what each turn measured."""

    variant: Variant
    flags: list[str]
    convs: list[Conversation]
    servers: list[ServerProcess] = field(default_factory=list)
    retired: list[ServerProcess] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)

    def server_for(self, turn: int) -> tuple[str, ServerProcess]:
        """The server of 0-based `turn` and its name in the table."""
        if len(self.servers) > 1:
            index = turn % len(self.servers)
            return "AB"[index], self.servers[index]
        return f"#{len(self.retired) + 1}", self.servers[0]


def disk_metrics(server: ServerProcess) -> dict[str, float]:
    """The disk tier's counters (nan where the server does not export one)."""
    values = server.metrics()
    return {name: values.get(name, float("nan")) for name in DISK_METRICS}


def server_flags(args: argparse.Namespace, variant: Variant, folder: Path) -> list[str]:
    # always passed (0: auto): ServerProcess, the tests' launcher, pins one torch thread
    flags = shlex.split(args.launch) + ["--threads", str(args.threads)]
    if not variant.disk:
        return flags
    flags += ["--cache-disk", str(folder), "--cache-disk-size", str(args.disk_gib)]
    if args.write_out is not None:
        flags += ["--cache-disk-write-out", str(args.write_out)]
    return flags


def start_all(servers: list[ServerProcess]) -> float:
    """Start servers side by side (a model load is mostly waiting); seconds until all answer."""
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(ServerProcess.start, servers))
    return time.perf_counter() - started


def page_files(folder: Path) -> tuple[int, int]:
    """(files, bytes) of the disk tier's pages under `folder`."""
    files = [f for f in folder.rglob("*.kvpage") if f.is_file()]
    return len(files), sum(f.stat().st_size for f in files)


def terminate(server: ServerProcess, wait: float) -> dict:
    """SIGTERM and wait for the exit (SIGKILL after `wait` seconds, which the record shows)."""
    before = disk_metrics(server)
    started = time.perf_counter()
    code = server.stop(signal.SIGTERM, timeout=wait)
    return {"exit_code": code, "killed": code == -signal.SIGKILL,
            "exit_seconds": time.perf_counter() - started, "metrics_before": before,
            "log": str(server.log_path)}


def restart(runs: list[Run], folders: dict[str, Path], model: str, wait: float) -> None:
    """Stop every restart variant's server, one at a time, then start their successors."""
    for run in runs:
        old = run.servers[0]
        record = terminate(old, wait)
        record["files_after_exit"], record["bytes_after_exit"] = page_files(
            folders[run.variant.key])
        run.restarts.append(record)
        run.retired.append(old)
        run.servers = [ServerProcess(run.flags, model=model)]
    seconds = start_all([run.servers[0] for run in runs])
    for run in runs:
        run.restarts[-1].update(start_seconds=seconds,
                                metrics_after_start=disk_metrics(run.servers[0]))
        print(f"restart {run.variant.key}: exit {run.restarts[-1]['exit_code']} after "
              f"{run.restarts[-1]['exit_seconds']:.1f} s, "
              f"{run.restarts[-1]['files_after_exit']} page files on disk")


def play_turn(run: Run, turn: int, script: list[list[tuple[str, int]]]) -> None:
    """All conversations' turn `turn` (0-based) at once on the variant's server for it."""
    name, server = run.server_for(turn)
    before = disk_metrics(server)
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(len(run.convs)) as pool:
        done = list(pool.map(chat_turn, [server.url] * len(run.convs), run.convs,
                             *zip(*(script[c.index][turn] for c in run.convs))))
    wall = time.perf_counter() - started
    after = disk_metrics(server)
    run.turns.append({"turn": turn + 1, "server": name, "wall_seconds": wall,
                      **{key: after[m] - before[m] for key, m in COUNTED.items()},
                      "metrics_after": after, "requests": done})
    print(f"turn {turn + 1} {run.variant.key} ({name}): median ttft "
          f"{ttft_ms(run.turns[-1], 50):.0f} ms, prompt "
          f"{sum(d['prompt_tokens'] for d in done)}, cached "
          f"{sum(d['cached_tokens'] for d in done)}, errors "
          f"{sum(d['error'] is not None for d in done)}")


def ttft_ms(record: dict, pct: float) -> float:
    """A percentile of the turn's TTFTs (interpolated: p50 is the median), in ms."""
    return percentile([d["ttft"] for d in record["requests"] if d["ttft"] is not None], pct) * 1e3


def cached_share(record: dict) -> float:
    prompt = sum(d["prompt_tokens"] for d in record["requests"])
    return sum(d["cached_tokens"] for d in record["requests"]) / max(1, prompt)


def turn_row(record: dict) -> list[object]:
    requests = record["requests"]
    return [record["turn"], record["server"], f"{ttft_ms(record, 50):.0f}",
            f"{ttft_ms(record, 95):.0f}", sum(d["prompt_tokens"] for d in requests),
            sum(d["cached_tokens"] for d in requests), f"{100 * cached_share(record):.1f}%",
            *("-" if math.isnan(record[key]) else f"{record[key]:.0f}" for key in COUNTED),
            sum(d["error"] is not None for d in requests)]


def print_runs(runs: list[Run]) -> None:
    headers = ["turn", "server", "ttft ms median", "ttft ms p95", "prompt tokens",
               "cached tokens", "cached %", "disk pages read", "written", "dropped", "errors"]
    for run in runs:
        print(f"\n({run.variant.key}) {run.variant.label}")
        print_table(headers, [turn_row(record) for record in run.turns])
        for record in run.restarts:
            print(f"restart: SIGTERM -> exit {record['exit_code']} in "
                  f"{record['exit_seconds']:.1f} s{' (killed)' if record['killed'] else ''}, "
                  f"{record['files_after_exit']} page files "
                  f"({record['bytes_after_exit'] / (1 << 20):.0f} MiB) on disk; "
                  f"new server healthy after {record['start_seconds']:.1f} s")


def summary(runs: dict[str, Run], turn: int) -> dict:
    """The turn after the restart (1-based `turn`) against c; d's cached share per turn."""
    result: dict = {"turn": turn}
    reference = runs.get("c")
    for key in ("a", "b", "c"):
        if key in runs and len(runs[key].turns) >= turn:
            record = runs[key].turns[turn - 1]
            result[key] = {"median_ms": ttft_ms(record, 50), "p95_ms": ttft_ms(record, 95),
                           "cached_share": cached_share(record)}
    for key in ("a", "b"):
        if key in result and reference is not None and "c" in result:
            for stat in ("median_ms", "p95_ms"):
                result[key][f"{stat[:-3]}_vs_c"] = result[key][stat] / result["c"][stat]
    if "d" in runs:
        result["d_cached_share"] = [cached_share(record) for record in runs["d"].turns]
    return result


def print_summary(result: dict) -> None:
    turn = result["turn"]
    parts = []
    for key in ("a", "b"):
        if "median_vs_c" in result.get(key, {}):
            met = "met" if result[key]["median_vs_c"] <= TARGET else "MISSED"
            mark = f" (target <= {TARGET}x: {met})" if key == "a" else ""
            parts.append(f"({key}) {result[key]['median_ms']:.0f} ms = "
                         f"{result[key]['median_vs_c']:.2f}x (c){mark}, p95 "
                         f"{result[key]['p95_vs_c']:.2f}x")
    if "c" in result:
        parts.append(f"(c) {result['c']['median_ms']:.0f} ms")
    if parts:
        print(f"\nturn {turn} (first after the restart), median TTFT: " + "; ".join(parts))
    if "d_cached_share" in result:
        shares = enumerate(result["d_cached_share"], 1)
        print("(d) cached share per turn: " + " ".join(f"t{t} {100 * s:.0f}%" for t, s in shares))


def make_script(args: argparse.Namespace) -> list[list[tuple[str, int]]]:
    """Every conversation's new words per turn: the same for every variant."""
    rng = random.Random(args.seed)
    return [[(new_words(rng, args.first_words if t == 0 else args.words), args.max_tokens)
             for t in range(args.turns)] for _ in range(args.conversations)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", default="-np 4 -c 8192", help="flags of every kvpark server")
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--threads", type=int, default=0, help="kvpark --threads")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    p.add_argument("--conversations", "-C", type=int, default=16)
    p.add_argument("--turns", "-T", type=int, default=6)
    p.add_argument("--restart-after", type=int, default=3, help="turn after which a, b restart")
    p.add_argument("--first-words", type=int, default=250, help="words of the first turn")
    p.add_argument("--words", type=int, default=30, help="new words per later turn")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--disk-gib", type=float, default=2.0, help="--cache-disk-size")
    p.add_argument("--write-out", type=float, help="--cache-disk-write-out (server default)")
    p.add_argument("--stop-wait", type=float, default=120.0,
                   help="seconds from SIGTERM to the exit before SIGKILL")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/disk_restart.json")
    args = p.parse_args()
    if not 0 < args.restart_after < args.turns:
        p.error("--restart-after must be a turn before the last")
    return args


def main() -> None:
    args = parse_args()
    script = make_script(args)
    scratch = Path(tempfile.mkdtemp(prefix="kvpark-disk-restart-"))
    folders = {key: scratch / key for key in args.variants}
    runs: dict[str, Run] = {}
    for key in args.variants:
        variant = VARIANTS[key]
        flags = server_flags(args, variant, folders[key])
        runs[key] = Run(variant, flags, [Conversation(i) for i in range(args.conversations)],
                        [ServerProcess(flags, model=args.model) for _ in range(variant.servers)])
    started = time.perf_counter()
    try:
        start_all([s for run in runs.values() for s in run.servers])
        for turn in range(args.turns):
            if turn == args.restart_after:
                restart([r for r in runs.values() if r.variant.restart], folders, args.model,
                        args.stop_wait)
            for run in runs.values():  # alternate: same conditions for every variant
                play_turn(run, turn, script)
    finally:
        for run in runs.values():
            for server in run.servers:
                server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.perf_counter() - started
    print(f"\n{args.conversations} conversations x {args.turns} turns, {args.first_words} words "
          f"first, {args.words} new words per turn, {args.max_tokens} generated; restart after "
          f"turn {args.restart_after}; kvpark {args.launch}, model {args.model}; {wall:.0f} s")
    print_runs(list(runs.values()))
    result = summary(runs, args.restart_after + 1)
    print_summary(result)
    write_json(args.out, {"args": vars(args), "wall_seconds": wall, "summary": result,
                          "variants": {key: variant_json(run) for key, run in runs.items()}})


def variant_json(run: Run) -> dict:
    return {"label": run.variant.label, "flags": run.flags, "restarts": run.restarts,
            "logs": [str(s.log_path) for s in run.retired + run.servers],
            "turns": [{k: v for k, v in record.items() if k != "requests"}
                      | {"requests": [request_json(d) for d in record["requests"]]}
                      for record in run.turns]}


def request_json(turn: dict) -> dict:
    keys = ("ttft", "seconds", "prompt_tokens", "cached_tokens", "completion_tokens", "error")
    return {key: turn[key] for key in keys}


if __name__ == "__main__":
    main()
