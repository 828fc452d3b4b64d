"""C concurrent multi-turn chats, each turn re-sending the whole history: prefix cache on vs off.

    python benchmarks/multiturn.py --conversations 4 --turns 6
    python benchmarks/multiturn.py --launch "-np 4 -c 8192" --peer http://127.0.0.1:8081
    python benchmarks/multiturn.py --compare host-cache -C 16 --first-words 700 --words 80 \
        --max-tokens 64 --launch "-np 4 -c 4096" --peer http://127.0.0.1:8081

Two kvpark servers are launched with the same flags, one with --no-prefix-cache (or, with
`--compare host-cache`, one with --no-host-cache: the prefix cache's host-RAM tier off); with
--peer an OpenAI-compatible server (llama-server caches prompts by default) joins them. Every
turn adds about 60 new words (`--first-words` for the first turn) and asks for 48-64 tokens
(`--max-tokens` to fix it; seeded, the same for every target, ignore_eos). The targets
alternate turn by turn, so they see the same machine conditions. Printed per target: total
wall, generated tok/s, completed conversations, prompt tokens computed vs cached, host RAM at
peak vs the budget, and the median and p95 time to first token at each turn index; the JSON
keeps every turn's TTFT, tokens and `cached_tokens`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import shlex
import time
from dataclasses import dataclass, field

import httpx
from plotting import LATENCY_HEADERS, latency_cells, latency_summary, plot_latency
from workload import TLS, ServerProcess, gaps, median, print_table, write_json

MIB = 1 << 20
COMPARED = {"prefix-cache": ("cache on", "cache off", "--no-prefix-cache"),
            "host-cache": ("host tier on", "host tier off", "--no-host-cache")}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def host_ram(server: ServerProcess) -> tuple[float, float]:
    """(peak host bytes held, budget) of a kvpark server, in MiB."""
    m = server.metrics()
    return m["kvpark:host_ram_peak_bytes"] / MIB, m["kvpark:preempt_ram_budget_bytes"] / MIB

WORDS = ("river stone lantern orchard harbor meadow copper violin thunder pebble garden "
         "compass window ladder candle forest marble bridge feather canyon island mirror "
         "saddle winter ribbon falcon anchor basket engine silver").split()


def new_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


@dataclass
class Conversation:
    index: int
    messages: list[dict] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)


def chat_turn(url: str, conv: Conversation, text: str, max_tokens: int) -> dict:
    conv.messages.append({"role": "user", "content": text})
    body = {"model": "default", "messages": conv.messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "seed": 1234,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft, parts, usage, error = None, [], {}, None
    arrivals: list[float] = []  # of each chunk with text
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                          timeout=1800, verify=TLS) as response:
            if response.status_code != 200:
                error = response.read().decode()
            for line in response.iter_lines() if error is None else ():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # llama-server reports a failure mid-stream, after the 200
                    error = json.dumps(chunk["error"])
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        arrivals.append(time.perf_counter())
                    if content and ttft is None:
                        ttft = time.perf_counter() - started
                    parts.append(content or "")
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if error is None and not usage.get("completion_tokens") and not "".join(parts):
        error = "no answer"
    conv.messages.append({"role": "assistant", "content": "".join(parts)})
    details = usage.get("prompt_tokens_details") or {}
    turn = {"ttft": ttft, "itl": gaps(arrivals), "seconds": time.perf_counter() - started,
            "error": error,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0)}
    conv.turns.append(turn)
    return turn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch", default="-np 4 -c 8192", help="flags of both kvpark servers")
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--threads", type=int, default=0, help="kvpark --threads")
    p.add_argument("--peer", help="another OpenAI-compatible server, e.g. llama-server")
    p.add_argument("--conversations", "-C", type=int, default=4)
    p.add_argument("--turns", "-T", type=int, default=6)
    p.add_argument("--words", type=int, default=60, help="new words per turn")
    p.add_argument("--first-words", type=int, help="words of the first turn (default --words)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per answer (0: 48-64)")
    p.add_argument("--compare", choices=sorted(COMPARED), default="prefix-cache",
                   help="the kvpark feature turned off in the second server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/multiturn.json")
    args = p.parse_args()

    # always passed (0: auto): ServerProcess, the tests' launcher, pins one torch thread
    flags = shlex.split(args.launch) + ["--threads", str(args.threads)]
    on, off, off_flag = COMPARED[args.compare]
    servers = {on: ServerProcess(flags, model=args.model),
               off: ServerProcess([*flags, off_flag], model=args.model)}
    rng = random.Random(args.seed)
    script = [[(new_words(rng, args.first_words if t == 0 and args.first_words else args.words),
                args.max_tokens or rng.randint(48, 64)) for t in range(args.turns)]
              for _ in range(args.conversations)]
    memory: dict[str, tuple[float, float]] = {}
    try:
        targets = {name: s.start().url for name, s in servers.items()}
        if args.peer:
            targets["peer"] = args.peer
        convs = {name: [Conversation(i) for i in range(args.conversations)] for name in targets}
        walls = dict.fromkeys(targets, 0.0)
        for t in range(args.turns):
            for name, url in targets.items():  # alternate: same conditions for every target
                started = time.perf_counter()
                with cf.ThreadPoolExecutor(args.conversations) as pool:
                    done = list(pool.map(chat_turn, [url] * len(convs[name]), convs[name],
                                         *zip(*(script[c.index][t] for c in convs[name]))))
                walls[name] += time.perf_counter() - started
                print(f"turn {t + 1} {name}: median ttft "
                      f"{median([d['ttft'] or 0 for d in done]) * 1e3:.0f} ms, prompt "
                      f"{median([d['prompt_tokens'] for d in done]):.0f} tokens, cached "
                      f"{median([d['cached_tokens'] for d in done]):.0f}")
        memory = {name: host_ram(server) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    rows, ttft_rows, latency, series = [], [], {}, {}
    for name in targets:
        turns = [c.turns for c in convs[name]]
        series[name] = ([d["ttft"] for ts in turns for d in ts if d["ttft"] is not None],
                        [g for ts in turns for d in ts for g in d["itl"]])
        latency[name] = latency_summary(*series[name])
        tokens = sum(d["completion_tokens"] for ts in turns for d in ts)
        completed = sum(all(d["error"] is None for d in ts) for ts in turns)
        prompt = sum(d["prompt_tokens"] for ts in turns for d in ts)
        cached = sum(d["cached_tokens"] for ts in turns for d in ts)
        peak, budget = memory.get(name, (float("nan"), float("nan")))
        rows.append([name, f"{walls[name]:.1f}", f"{tokens / walls[name]:.1f}",
                     f"{completed}/{len(turns)}", prompt - cached, cached,
                     f"{100 * cached / max(1, prompt):.1f}%", f"{peak:.0f} / {budget:.0f}",
                     *latency_cells(latency[name])])
        for label, share in (("median", 0.5), ("p95", 0.95)):
            ttfts = [percentile([ts[t]["ttft"] for ts in turns if ts[t]["ttft"] is not None],
                                share) for t in range(args.turns)]
            ttft_rows.append([name, label, *(f"{v * 1e3:.0f}" for v in ttfts)])
    first = f"{args.first_words} words first, " if args.first_words else ""
    answer = args.max_tokens or "48-64"
    print(f"\n{args.conversations} conversations x {args.turns} turns, {first}~{args.words} new "
          f"words per turn, {answer} generated; kvpark {args.launch}, model {args.model}")
    print_table(["target", "wall s", "gen tok/s", "completed", "prompt computed", "cached",
                 "cached %", "host MiB peak / budget", *LATENCY_HEADERS], rows)
    print()
    print_table(["target", "ttft ms", *(f"t{t + 1}" for t in range(args.turns))], ttft_rows)
    write_json(args.out, {"args": vars(args), "wall_seconds": walls, "latency": latency,
                          "host_ram_mib": memory,
                          "turns": {n: [c.turns for c in convs[n]] for n in targets}})
    plot_latency(args.out, series, f"multiturn: {args.conversations} conversations x "
                 f"{args.turns} turns")


if __name__ == "__main__":
    main()
