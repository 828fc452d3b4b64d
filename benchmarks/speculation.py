"""Speculative decoding by prompt lookup (`--spec-type ngram-simple`) on vs off, and a peer.

    python benchmarks/speculation.py                      # launches kvpark off and on
    python benchmarks/speculation.py --peer http://127.0.0.1:8082 --rounds 2

Two workloads: "copy" asks to repeat a ~400-word text with one word changed (the answer copies
its prompt: drafts should be accepted), "story" asks for free story text (drafts mostly fail:
the adaptive pause must keep the cost near zero; sampled at temperature 0.8 with a seed, since
greedy a 135M model soon loops, and a loop is text the lookup predicts). Each at 1 and 4
concurrent streaming chats, `ignore_eos`, the servers taking turns within each round.

Decode tok/s: per chat, (completion tokens - 1) / (last token - first token); the median chat.
Aggregate tok/s: all completion tokens of a round / its wall time (prefill included).
Acceptance: accepted / drafted tokens, from each chat's final `timings` where the stream has
them (llama-server's `draft_n`, `draft_n_accepted`), else from the server's /metrics before and
after the round (kvpark's spec_decode_* counters). TTFT: median time to the first streamed text.
Every prompt starts with a line unique to its round, so no prefix cache skips a prefill.

    python benchmarks/speculation.py --step-rows        # what a drafted step costs, in-process

`--step-rows` times the runner on one decode step of 1 and of 4 sequences (~600-token contexts)
fed 1..8 rows each (the last token and 0..7 draft tokens), rounds alternating: what a draft row
costs against a plain decode row on this machine.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shlex
import time
from dataclasses import dataclass, field

import httpx
from workload import (
    LIGHTHOUSE,
    TLS,
    ServerProcess,
    median,
    parse_metrics,
    print_table,
    write_json,
)

DRAFTED = "kvpark:spec_decode_num_draft_tokens_total"
ACCEPTED = "kvpark:spec_decode_num_accepted_tokens_total"

TEXT = (
    LIGHTHOUSE + "\n\n"
    "The last keeper was a woman named Margaret Hale, who took the post after her father fell "
    "ill and kept it for thirty-one years. She wrote in the logbook every night: the wind, the "
    "state of the sea, the ships she saw and the hour the lamp was lit. Her handwriting was "
    "small and careful, and the logbooks now fill a whole shelf in the town museum. In the "
    "winter of the great storm she kept the lamp burning for three days without sleep, and a "
    "grain ship that had lost its mast found the harbour by her light alone. The captain came "
    "back the next summer with a silver clock, which still stands on the cottage mantelpiece.\n\n"
    "Visitors who climb the tower today find a narrow iron stair that turns to the left, a "
    "small window on every landing, and at the top a brass door that opens onto the gallery. "
    "From there the whole coast can be seen on a clear day: the long beach to the south, the "
    "cliffs to the north, the church tower in the village and the three islands where seals "
    "rest on the rocks. The wind is always stronger at the top than anyone expects, and the "
    "guides tell every group to hold the rail with both hands. Many people say that the view "
    "is worth every one of the steps, and some come back year after year to see it again in "
    "a different season, when the light on the water has changed.")
COPY = ('Repeat the following text exactly, word for word, but write "beacon" instead of the '
        'first "lighthouse". Output only the text.\n\n' + TEXT)
STORIES = ["a fox who learns to sail", "a baker who finds a map in the flour",
           "two sisters who build a radio", "a robot that tends a garden"]


@dataclass
class Chat:
    tokens: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    decode_tok_s: float | None = None
    draft_n: int = 0
    draft_n_accepted: int = 0
    error: str | None = None
    arrivals: list[float] = field(default_factory=list, repr=False)


def prompt_for(workload: str, index: int, salt: str) -> str:
    head = f"Request {salt}, chat {index}.\n"  # a distinct first line: no prefix-cache hits
    if workload == "copy":
        return head + COPY
    return head + f"Write a long story about {STORIES[index % len(STORIES)]}."


def stream(url: str, prompt: str, max_tokens: int, temperature: float) -> Chat:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "seed": 1234, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    chat = Chat()
    started = time.perf_counter()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                          timeout=1800, verify=TLS) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                    chat.arrivals.append(time.perf_counter())
                if chunk.get("usage"):
                    chat.tokens = chunk["usage"]["completion_tokens"]
                timings = chunk.get("timings") or {}
                chat.draft_n = timings.get("draft_n", chat.draft_n)
                chat.draft_n_accepted = timings.get("draft_n_accepted", chat.draft_n_accepted)
    except httpx.HTTPError as exc:
        chat.error = f"{type(exc).__name__}: {exc}"
    chat.seconds = time.perf_counter() - started
    if chat.arrivals:
        chat.ttft = chat.arrivals[0] - started
        span = chat.arrivals[-1] - chat.arrivals[0]
        chat.decode_tok_s = (chat.tokens - 1) / span if span > 0 else None
    return chat


def spec_counters(url: str) -> tuple[float, float]:
    """kvpark's drafted and accepted tokens so far (its stream has no per-chat timings);
    zeros for a server without them."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=10)
        values = parse_metrics(response.text) if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):  # llama-server without --metrics: 501
        return 0.0, 0.0
    return values.get(DRAFTED, 0.0), values.get(ACCEPTED, 0.0)


def run_round(url: str, workload: str, concurrency: int, max_tokens: int, temperature: float,
              salt: str) -> dict:
    prompts = [prompt_for(workload, i, salt) for i in range(concurrency)]
    before = spec_counters(url)
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        chats = list(pool.map(lambda p: stream(url, p, max_tokens, temperature), prompts))
    wall = time.perf_counter() - started
    after = spec_counters(url)
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    if drafted and not any(c.draft_n for c in chats):  # the server's counters, not the chats'
        chats[0].draft_n, chats[0].draft_n_accepted = int(drafted), int(accepted)
    return {"chats": chats, "wall": wall, "tokens": sum(c.tokens for c in chats)}


def summarise(runs: list[dict]) -> dict:
    chats = [c for r in runs for c in r["chats"]]
    drafted = sum(c.draft_n for c in chats)
    return {
        "decode_tok_s": median([c.decode_tok_s for c in chats if c.decode_tok_s]),
        "aggregate_tok_s": median([r["tokens"] / r["wall"] for r in runs]),
        "ttft_s": median([c.ttft for c in chats if c.ttft is not None]),
        "acceptance": sum(c.draft_n_accepted for c in chats) / drafted if drafted else None,
        "drafted": drafted, "errors": [c.error for c in chats if c.error],
        "completed": sum(c.error is None and c.tokens > 0 for c in chats), "chats": len(chats)}


def launch(flags: str, model: str, threads: int) -> ServerProcess:
    # always passed: ServerProcess (the tests' launcher) pins one torch thread otherwise
    extra = ["--threads", str(threads)]
    server = ServerProcess(shlex.split(flags) + extra, model=model).start()
    print(f"launched kvpark {flags} at {server.url}", flush=True)
    return server


def step_rows(threads: int, rounds: int = 7, max_rows: int = 8) -> None:
    """ms per step for `batch` sequences of `rows` rows each, median over alternating rounds."""
    from kvpark.pod.args import parse_args
    from kvpark.pod.core.messages import Submission
    from kvpark.pod.core.sequence import Sequence
    from kvpark.pod.core.step_plan import ScheduledSeq
    from kvpark.pod.sampling.sampler import SamplingParams, make_generator
    from kvpark.pod.serving.stack import build_stack

    stack = build_stack(parse_args(["--model", "builtin://smollm2-135m", "-np", "4", "-c", "8192",
                                    "--weights", "gguf", "--threads", str(threads)], env={}))
    engine, pool = stack.engine, stack.scheduler.pool
    seqs = []
    for i in range(4):
        ids = stack.tokenizer.encode(prompt_for("copy", i, "rows"))
        seq = Sequence(Submission(f"r{i}", tuple(ids), SamplingParams(temperature=0,
                                  max_tokens=1000), 0, lambda *a: None), make_generator(0))
        engine.scheduler.add(seq)
        seqs.append(seq)
    while any(s.in_prompt for s in seqs):
        engine.step()  # prefill; each sequence then holds one sampled token
    for seq in seqs:
        seq.page_table.extend(pool.allocate(1))  # room for 8 more rows at any offset
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(rounds):
        for batch in (1, 4):
            for rows in range(1, max_rows + 1):
                plan = [ScheduledSeq(s, 1, tuple(s.tokens[5:4 + rows])) for s in seqs[:batch]]
                started = time.perf_counter()
                engine.runner.run(plan)  # changes no sequence
                times.setdefault((batch, rows), []).append(time.perf_counter() - started)
    table = []
    for (batch, rows), samples in times.items():
        ms = median(samples) * 1e3
        plain = median(times[(batch, 1)]) * 1e3
        table.append([batch, rows, batch * rows, f"{ms:.1f}", f"{ms / plain:.2f}x",
                      f"{ms / (batch * rows):.2f}"])
    print_table(["sequences", "rows each", "rows", "step ms", "vs 1 row each", "ms per row"],
                table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-rows", action="store_true",
                   help="time drafted steps in-process instead of serving")
    p.add_argument("--launch", default="-np 4 -c 8192", help="flags of both kvpark servers")
    p.add_argument("--spec", default="--spec-type ngram-simple",
                   help="flags the 'on' server adds")
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument("--threads", type=int, default=0, help="kvpark --threads (0: auto)")
    p.add_argument("--off-url", help="a running kvpark with speculation off (else launched)")
    p.add_argument("--on-url", help="a running kvpark with speculation on (else launched)")
    p.add_argument("--peer", help="another server, e.g. llama-server --spec-type ngram-simple")
    p.add_argument("--workloads", nargs="+", default=["copy", "story"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--copy-tokens", type=int, default=480, help="max_tokens of a copy chat")
    p.add_argument("--story-tokens", type=int, default=256, help="max_tokens of a story chat")
    p.add_argument("--story-temperature", type=float, default=0.8,
                   help="story chats are sampled (seed 1234): greedy, a small model loops, and "
                   "a loop is text the lookup predicts, not free text")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/speculation.json")
    args = p.parse_args()
    if args.step_rows:
        step_rows(args.threads)
        return

    servers = []
    try:
        targets = {}
        for name, url, extra in (("kvpark off", args.off_url, ""),
                                 ("kvpark on", args.on_url, args.spec)):
            if url is None:
                servers.append(launch(f"{args.launch} {extra}", args.model, args.threads))
                url = servers[-1].url
            targets[name] = url
        if args.peer:
            targets["peer"] = args.peer
        measured: dict[tuple[str, str, int], list[dict]] = {}
        for round_no in range(args.rounds):
            for workload in args.workloads:
                max_tokens = args.copy_tokens if workload == "copy" else args.story_tokens
                temperature = 0.0 if workload == "copy" else args.story_temperature
                for concurrency in args.concurrency:
                    for name, url in targets.items():  # alternating: same conditions for all
                        salt = f"{round_no}.{workload}.{concurrency}.{name}"
                        result = run_round(url, workload, concurrency, max_tokens, temperature,
                                           salt)
                        measured.setdefault((workload, concurrency, name), []).append(result)
                        s = summarise([result])
                        print(f"{workload} x{concurrency} {name}: decode {s['decode_tok_s']:.1f}"
                              f" tok/s, aggregate {s['aggregate_tok_s']:.1f} tok/s, ttft "
                              f"{s['ttft_s']:.2f} s, acceptance {fmt_rate(s['acceptance'])}",
                              flush=True)
    finally:
        for server in servers:
            server.stop()
    rows, summary = [], {}
    for (workload, concurrency, name), runs in measured.items():
        s = summarise(runs)
        summary[f"{workload} x{concurrency} {name}"] = s
        base = summarise(measured[(workload, concurrency, "kvpark off")])
        rows.append([workload, concurrency, name, f"{s['completed']}/{s['chats']}",
                     f"{s['decode_tok_s']:.1f}", f"{s['decode_tok_s'] / base['decode_tok_s']:.2f}x",
                     f"{s['aggregate_tok_s']:.1f}", fmt_rate(s["acceptance"]),
                     f"{s['ttft_s']:.2f}"])
    print(f"\nignore_eos; copy greedy, {args.copy_tokens} tokens per chat; story temperature "
          f"{args.story_temperature} seed 1234, {args.story_tokens} tokens; median over "
          f"{args.rounds} round(s)")
    print_table(["workload", "chats", "server", "completed", "decode tok/s", "vs off",
                 "aggregate tok/s", "acceptance", "TTFT s"], rows)
    write_json(args.out, {"args": vars(args), "summary": summary,
                          "rounds": {" ".join(map(str, k)): [
                              {"wall": r["wall"], "tokens": r["tokens"],
                               "chats": [{k2: v for k2, v in vars(c).items() if k2 != "arrivals"}
                                         for c in r["chats"]]} for r in v]
                              for k, v in measured.items()}})


def fmt_rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0%}"


if __name__ == "__main__":
    main()
