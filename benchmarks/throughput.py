"""N concurrent streaming chats against an OpenAI-compatible server: aggregate tokens/s.

    python benchmarks/throughput.py --url http://127.0.0.1:8080 --concurrency 1 4
    python benchmarks/throughput.py --launch "-np 4 -c 8192" --concurrency 1 4
    python benchmarks/throughput.py --launch "-np 4 -c 8192" --peer http://127.0.0.1:8081

Aggregate tok/s = completion tokens of all chats / wall time of the round (prefill included).
Prefill tok/s = prompt tokens / time to the first token of one ~--prompt-tokens prompt sent
alone (max_tokens 1), measured before each row's chats. Every prompt starts with a line unique
to its round, so a prompt cache never skips a prefill. With --peer the same workload runs
against the peer in the same run, alternating rounds, and the table shows the ratios
kvpark / peer.

The kvpark vs llama-server table (issue 17), each server started with the same -c:
    python benchmarks/throughput.py --url URL --peer PEER --concurrency 1 4   # both at -c 8192
    python benchmarks/throughput.py --url URL --peer PEER --concurrency 4     # both at -c 4096
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shlex
import time

import httpx
from plotting import LATENCY_HEADERS, latency_cells, latency_summary, plot_latency
from workload import TLS, ServerProcess, long_prompt, median, print_table, stream_chat, write_json


def measure_prefill(url: str, prompt_tokens: int, salt: str) -> dict:
    """One prompt alone, one token out: prompt tokens (the server's count) / time to the first
    streamed token."""
    body = {"model": "default", "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": long_prompt(0, prompt_tokens,
                                                                  f"prefill {salt}")}]}
    started = time.perf_counter()
    first, prompt = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600,
                      verify=TLS) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                prompt = chunk["usage"]["prompt_tokens"]
    ttft = first if first is not None else time.perf_counter() - started
    return {"prompt_tokens": prompt, "ttft_s": ttft, "tok_s": prompt / ttft}


def run_round(url: str, concurrency: int, prompt_tokens: int, max_tokens: int,
              salt: str) -> dict:
    # each server sees each prompt once: no prefix-cache hits from an earlier round
    prompts = [long_prompt(i, prompt_tokens, salt) for i in range(concurrency)]
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream_chat(url, p, max_tokens), prompts))
    wall = time.perf_counter() - started
    tokens = sum(r.completion_tokens for r in results)
    return {"concurrency": concurrency, "completed": sum(r.ok for r in results),
            "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
            "errors": [r.error for r in results if r.error],
            "ttft": [r.ttft for r in results if r.ttft is not None],
            "itl": [gap for r in results for gap in r.itl]}


def prefill_tok_s(rounds: list[dict]) -> float:
    return median([r["prefill"]["tok_s"] for r in rounds])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="server to measure (default: launch kvpark)")
    p.add_argument("--launch", default="-np 4 -c 8192",
                   help="flags for a kvpark server this script starts when --url is absent")
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--threads", type=int, default=0,
                   help="kvpark --threads when launching (0: auto)")
    p.add_argument("--peer", help="another OpenAI-compatible server to compare against")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/throughput.json")
    args = p.parse_args()

    server = None
    url = args.url
    if url is None:
        flags = shlex.split(args.launch)
        # always passed (0: auto): ServerProcess, the tests' launcher, pins one torch thread
        flags += ["--threads", str(args.threads)]
        server = ServerProcess(flags, model=args.model).start()
        server_threads = args.threads or "auto"
        url = server.url
        print(f"launched kvpark {args.launch} (threads {server_threads}) at {url}")
    try:
        targets = {"kvpark": url, **({"peer": args.peer} if args.peer else {})}
        measured: dict[tuple[str, int], list[dict]] = {}
        for round_no in range(args.rounds):
            for concurrency in args.concurrency:
                for name, target in targets.items():  # alternate: same conditions for both
                    salt = f"{round_no}.{concurrency}"
                    prefill = measure_prefill(target, args.prompt_tokens, f"{name} {salt}")
                    result = run_round(target, concurrency, args.prompt_tokens, args.max_tokens,
                                       salt=salt)
                    result["prefill"] = prefill
                    measured.setdefault((name, concurrency), []).append(result)
                    print(f"{name} x{concurrency}: {result['tok_s']:.1f} tok/s "
                          f"({result['completed']}/{concurrency} completed); prefill "
                          f"{prefill['prompt_tokens']} tokens in {prefill['ttft_s']:.2f} s")
    finally:
        if server is not None:
            server.stop()
    rows, latency, series = [], {}, {}
    for (name, concurrency), runs in measured.items():  # all rounds' samples together
        series[f"{name} x{concurrency}"] = ([t for r in runs for t in r["ttft"]],
                                            [t for r in runs for t in r["itl"]])
        latency[f"{name}x{concurrency}"] = latency_summary(*series[f"{name} x{concurrency}"])
    for concurrency in args.concurrency:
        ours = median([r["tok_s"] for r in measured[("kvpark", concurrency)]])
        our_prefill = prefill_tok_s(measured[("kvpark", concurrency)])
        done = sum(r["completed"] for r in measured[("kvpark", concurrency)])
        row = [concurrency, f"{done}/{concurrency * args.rounds}", f"{ours:.1f}",
               f"{our_prefill:.0f}", *latency_cells(latency[f"kvparkx{concurrency}"])]
        if args.peer:
            theirs = median([r["tok_s"] for r in measured[("peer", concurrency)]])
            their_prefill = prefill_tok_s(measured[("peer", concurrency)])
            peer_done = sum(r["completed"] for r in measured[("peer", concurrency)])
            row += [f"{peer_done}/{concurrency * args.rounds}", f"{theirs:.1f}",
                    f"{their_prefill:.0f}", f"{ours / theirs:.2f}x" if theirs else "n/a",
                    f"{our_prefill / their_prefill:.2f}x" if their_prefill else "n/a"]
        rows.append(row)
    headers = ["chats", "completed", "kvpark tok/s", "kvpark prefill tok/s", *LATENCY_HEADERS]
    if args.peer:
        headers += ["peer completed", "peer tok/s", "peer prefill tok/s", "ratio",
                    "prefill ratio"]
    print(f"\nprompt ~{args.prompt_tokens} tokens, {args.max_tokens} generated per chat, "
          f"median of {args.rounds} round(s)")
    print_table(headers, rows)
    write_json(args.out, {"args": vars(args), "latency": latency,
                          "rounds": {f"{k[0]}x{k[1]}": v for k, v in measured.items()}})
    plot_latency(args.out, series, f"throughput: ~{args.prompt_tokens}-token prompts, "
                 f"{args.max_tokens} generated")


if __name__ == "__main__":
    main()
