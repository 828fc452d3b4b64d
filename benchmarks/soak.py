"""Soak: mixed load with forced parks for N minutes against a kvpark server on loopback.

    python benchmarks/soak.py                      # 5 minutes, the seeded tiny model
    python benchmarks/soak.py --minutes 1 --model builtin://smollm2-135m --clients 8

It starts its own server on 127.0.0.1 (never anything else), with `KVPARK_PREEMPT_EVERY` so
every request is parked and resumed every few tokens, a pool too small for all slots so the
pool forces parks too, and a RAM budget small enough that some parks fall through to
recompute. `--clients` threads send requests back to back until the time is up: chat and
completions, streaming or not, prompts of ~60-500 tokens; one streaming request in ten hangs up
after a few tokens on purpose; a 503 is honoured by waiting its Retry-After. Every request is
bounded by a client timeout. A sampler reads `/metrics` and the server's RSS four times a
second.

Then, on the same server, idle again: `--distinct-requests` short completions whose prompts are
all distinct (random token ids, 5-600 tokens: a prompt chunk's row count is the shape of its
GEMMs), from 4 clients, in rounds; RSS is read between rounds, while the server is idle. The
median round's growth is the RSS slope per 1,000 distinct-prompt requests (issue 23: oneDNN
kept a JIT-compiled primitive per GEMM row count, ~70-80 MiB per 1,000 such requests). The
mixed load above is too slow and too uneven for a per-request slope: its RSS swings by tens of
MiB with parks and swaps.

It prints requests accepted / completed / errored / rejected (and hung up, and lost: timed out
or cut without an answer, which must be 0), the peak parked bytes against the budget, the park
counts, whether the server returned to idle with every page free and no parked bytes, and the
RSS slope; then writes it all to benchmarks/results/soak.json. Exit status 1 when anything was
lost, the server did not return to idle, a distinct-prompt request failed, or the RSS slope is
above `--max-rss-slope`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import shlex
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
from workload import TLS, ServerProcess, long_prompt, parse_metrics, print_table, write_json

MIB = 1 << 20
CLIENT_TIMEOUT = 120.0  # seconds; a request that takes longer counts as lost
SAMPLE_SECONDS = 0.25
TIMELINE_SECONDS = 5.0
DISTINCT_ROUNDS = 5  # measured rounds of the distinct-prompt phase, after one warm-up round
DISTINCT_CLIENTS = 4
DISTINCT_PROMPT_TOKENS = (5, 600)  # one chunk or two at the default --batch-size of 512
# MiB per 1,000 distinct-prompt requests: issue 23 measured 70-80; a warm server grows < 5
MAX_RSS_SLOPE_MIB = 20.0


@dataclass(frozen=True)
class Job:
    chat: bool
    stream: bool
    prompt: str | list[int]
    max_tokens: int
    hang_up_after: int  # streaming only: close after this many chunks (0: read to the end)


def make_job(rng: random.Random, index: int, scale: float) -> Job:
    prompt_tokens = int(rng.randint(60, 500) * scale)
    max_tokens = max(8, int(rng.randint(32, 256) * scale))
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    prompt: str | list[int] = (long_prompt(index, prompt_tokens) if chat else
                               [rng.randrange(1000, 40000) for _ in range(prompt_tokens)])
    hang_up = rng.randint(2, 12) if stream and rng.random() < 0.1 else 0
    return Job(chat, stream, prompt, max_tokens, hang_up)


def body_of(job: Job) -> dict:
    body = {"max_tokens": job.max_tokens, "stream": job.stream, "temperature": 0.7,
            "seed": 7, "ignore_eos": True}
    if job.chat:
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    return body


def send(url: str, job: Job) -> tuple[str, float, str]:
    """One request: (outcome, retry_after, detail); outcome is completed, errored, rejected,
    hung_up (on purpose) or lost (timed out or cut without an answer)."""
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    try:
        with httpx.stream("POST", f"{url}{path}", json=body_of(job),
                          timeout=CLIENT_TIMEOUT, verify=TLS) as response:
            if response.status_code == 503:
                response.read()
                return "rejected", float(response.headers.get("retry-after", "1")), ""
            if response.status_code != 200:
                response.read()
                return "errored", 0, f"HTTP {response.status_code}: {response.text[:200]}"
            if not job.stream:
                body = json.loads(response.read())
                tokens = body["usage"]["completion_tokens"]
                if tokens != job.max_tokens:
                    return "errored", 0, f"{tokens} of {job.max_tokens} tokens"
                return "completed", 0, ""
            return read_stream(response, job)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        return "lost", 0, f"{type(exc).__name__}: {exc}"


def read_stream(response: httpx.Response, job: Job) -> tuple[str, float, str]:
    chunks, finish, error = 0, None, None
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            if error:
                return "errored", 0, error
            return ("completed", 0, "") if finish == "length" else ("lost", 0, f"end {finish}")
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = chunk["error"]["message"]
            continue
        chunks += 1
        for choice in chunk.get("choices", []):
            finish = choice.get("finish_reason") or finish
        if job.hang_up_after and chunks >= job.hang_up_after:
            response.close()
            return "hung_up", 0, ""
    return "lost", 0, "stream ended without [DONE]"


class Sampler(threading.Thread):
    """Reads /metrics and VmRSS every SAMPLE_SECONDS until stopped."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.server = server
        self.stopped = threading.Event()
        self.peak: dict[str, float] = {}
        self.min_pages_free = float("inf")
        self.timeline: list[dict] = []
        self.num_samples = 0

    def run(self) -> None:
        started = last = time.monotonic()
        while not self.stopped.wait(SAMPLE_SECONDS):
            try:
                m = parse_metrics(httpx.get(f"{self.server.url}/metrics", timeout=10).text)
            except httpx.HTTPError:
                continue
            rss = self.server.rss_bytes()
            self.num_samples += 1
            for key, value in (("preempt_ram_bytes", m["kvpark:preempt_ram_bytes"]),
                               ("requests_preempted", m["kvpark:requests_preempted"]),
                               ("requests_deferred", m["kvpark:requests_deferred"]),
                               ("rss_bytes", rss)):
                self.peak[key] = max(self.peak.get(key, 0.0), value)
            self.min_pages_free = min(self.min_pages_free, m["kvpark:kv_cache_pages_free"])
            if time.monotonic() - last >= TIMELINE_SECONDS:
                last = time.monotonic()
                self.timeline.append({
                    "t": round(last - started, 1), "rss_mib": round(rss / MIB, 2),
                    "preempt_ram_bytes": m["kvpark:preempt_ram_bytes"],
                    "parked": m["kvpark:requests_preempted"],
                    "pages_free": m["kvpark:kv_cache_pages_free"],
                    "n_preempt": m["kvpark:n_preempt_total"]})


def run_clients(url: str, num_clients: int, seconds: float, scale: float, seed: int
                ) -> tuple[Counter, list[str]]:
    deadline = time.monotonic() + seconds
    counts: Counter = Counter()
    details: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        n = 0
        while time.monotonic() < deadline:
            outcome, retry_after, detail = send(url, make_job(rng, index * 100000 + n, scale))
            n += 1
            with lock:
                counts[outcome] += 1
                if detail and len(details) < 20:
                    details.append(f"{outcome}: {detail}")
            if outcome == "rejected":  # the client's side of the protocol: back off
                time.sleep(min(retry_after, max(0.0, deadline - time.monotonic())))

    with cf.ThreadPoolExecutor(num_clients) as pool:
        for future in [pool.submit(client, i) for i in range(num_clients)]:
            future.result()
    return counts, details


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once nothing runs, is queued or parked (or after `timeout` seconds)."""
    until = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["kvpark:requests_processing"] == 0 and m["kvpark:requests_deferred"] == 0
                and m["kvpark:requests_preempted"] == 0)
        if idle or time.monotonic() > until:
            return m
        time.sleep(0.05)  # polling for the server to settle, bounded by the timeout


def late_growth(timeline: list[dict]) -> float:
    """RSS growth in MiB between the middle and the end of the run."""
    if len(timeline) < 2:
        return 0.0
    return timeline[-1]["rss_mib"] - timeline[len(timeline) // 2]["rss_mib"]


@dataclass(frozen=True)
class RssSlope:
    """RSS growth per 1,000 distinct-prompt requests: the median of DISTINCT_ROUNDS rounds (a
    one-off step, such as a new allocator arena, lands in one round; a per-prompt cost in all)."""

    mib_per_1000: float
    rounds: list[float]  # each round's growth, MiB per 1,000 requests
    num_requests: int  # in the measured rounds
    num_failed: int  # requests not answered with 200 (warm-up included)


def distinct_body(rng: random.Random) -> dict:
    """A completion of a prompt no other request has (random ids) and of a random length."""
    length = rng.randint(*DISTINCT_PROMPT_TOKENS)
    return {"prompt": [rng.randrange(1000, 40000) for _ in range(length)], "max_tokens": 4,
            "temperature": 0}


def run_distinct_round(url: str, rng: random.Random, num_requests: int) -> int:
    """`num_requests` distinct prompts from DISTINCT_CLIENTS clients; returns how many failed.
    All have been answered when it returns, so the server is idle."""
    bodies = [distinct_body(rng) for _ in range(num_requests)]

    def post(body: dict) -> bool:
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    with cf.ThreadPoolExecutor(DISTINCT_CLIENTS) as pool:
        return sum(not ok for ok in pool.map(post, bodies))


def measure_rss_slope(server: ServerProcess, num_requests: int, seed: int) -> RssSlope:
    """One warm-up round (the GEMM shapes and arenas these prompts need), then DISTINCT_ROUNDS
    measured rounds, RSS read before and after each."""
    rng = random.Random(seed)
    per_round = max(1, num_requests // DISTINCT_ROUNDS)
    failed = run_distinct_round(server.url, rng, per_round)
    rounds = []
    for _ in range(DISTINCT_ROUNDS):
        before = server.rss_bytes()
        failed += run_distinct_round(server.url, rng, per_round)
        rounds.append((server.rss_bytes() - before) / MIB * 1000 / per_round)
    return RssSlope(statistics.median(rounds), [round(r, 2) for r in rounds],
                    per_round * DISTINCT_ROUNDS, failed)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> int:
    return int(after.get(name, 0) - before.get(name, 0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--model", default="synthetic:tiny")
    # -b: the server's default (512), so a step's row count (the GEMMs' shape) spans 1-512 as
    # in production; with -b 64 the distinct-prompt phase could not see per-shape memory
    p.add_argument("--launch", default="-np 8 -c 2048 --max-queue 12 --preempt-ram 1",
                   help="server flags (a pool too small for the slots, a 1 MiB swap budget)")
    p.add_argument("--preempt-every", type=int, default=32,
                   help="KVPARK_PREEMPT_EVERY: force a park every N generated tokens")
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply prompt and generation lengths (smaller for slow models)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--distinct-requests", type=int, default=1000,
                   help="measured requests of the distinct-prompt phase (0: skip it)")
    p.add_argument("--max-rss-slope", type=float, default=MAX_RSS_SLOPE_MIB,
                   help="fail above this many MiB of RSS per 1,000 distinct-prompt requests")
    p.add_argument("--out", default="benchmarks/results/soak.json")
    args = p.parse_args()

    flags = shlex.split(args.launch)
    env = {"KVPARK_PREEMPT_EVERY": str(args.preempt_every)}
    server = ServerProcess(flags, env=env, model=args.model).start()
    print(f"kvpark {args.model} {args.launch} (preempt every {args.preempt_every}) at "
          f"{server.url}; {args.clients} clients for {args.minutes:g} min")
    try:
        before = server.metrics()
        rss_start = server.rss_bytes()
        sampler = Sampler(server)
        sampler.start()
        started = time.monotonic()
        counts, details = run_clients(server.url, args.clients, args.minutes * 60, args.scale,
                                      args.seed)
        wall = time.monotonic() - started
        after = wait_idle(server)
        sampler.stopped.set()
        sampler.join()
        rss_end = server.rss_bytes()
        slope = (measure_rss_slope(server, args.distinct_requests, args.seed)
                 if args.distinct_requests > 0 else None)
    finally:
        server.stop()

    budget = after["kvpark:preempt_ram_budget_bytes"]
    peak_bytes = sampler.peak.get("preempt_ram_bytes", 0.0)
    accepted = sum(counts[k] for k in ("completed", "errored", "hung_up", "lost"))
    outcomes = {"accepted": accepted, **{k: counts[k] for k in
                ("completed", "errored", "rejected", "hung_up", "lost")}}
    parks = {name: delta(after, before, f"kvpark:{name}_total") for name in
             ("n_preempt", "n_preempt_swap", "n_preempt_recompute", "n_preempt_swap_fallback",
              "n_resume", "n_recompute_tokens")}
    idle = {
        "pages_free": after["kvpark:kv_cache_pages_free"],
        "pages_total": after["kvpark:kv_cache_pages_total"],
        "preempt_ram_bytes": after["kvpark:preempt_ram_bytes"],
        "requests_preempted": after["kvpark:requests_preempted"],
        "requests_processing": after["kvpark:requests_processing"],
    }
    server_counts = {
        "rejected": delta(after, before, "kvpark:requests_rejected_total"),
        "cancelled": delta(after, before, 'kvpark:requests_total{outcome="cancelled"}'),
        "length": delta(after, before, 'kvpark:requests_total{outcome="length"}'),
        "error": delta(after, before, 'kvpark:requests_total{outcome="error"}'),
    }
    clean = (idle["pages_free"] == idle["pages_total"] and idle["preempt_ram_bytes"] == 0
             and idle["requests_preempted"] == 0 and idle["requests_processing"] == 0)
    flat = slope is None or (slope.num_failed == 0 and slope.mib_per_1000 <= args.max_rss_slope)
    ok = clean and counts["lost"] == 0 and peak_bytes <= budget and flat
    print_table(["accepted", "completed", "errored", "rejected", "hung up", "lost"],
                [[outcomes[k] for k in ("accepted", "completed", "errored", "rejected",
                                        "hung_up", "lost")]])
    print()
    print_table(["peak parked", "budget", "peak / budget", "peak parked seqs", "min pages free",
                 "parks (swap / recompute / fallback)", "resumes", "recomputed tokens"],
                [[f"{peak_bytes / MIB:.3f} MiB", f"{budget / MIB:.0f} MiB",
                  f"{peak_bytes / budget:.0%}" if budget > 0 else "-",
                  int(sampler.peak.get("requests_preempted", 0)), int(sampler.min_pages_free),
                  f"{parks['n_preempt']} ({parks['n_preempt_swap']} / "
                  f"{parks['n_preempt_recompute']} / {parks['n_preempt_swap_fallback']})",
                  parks["n_resume"], parks["n_recompute_tokens"]]])
    print()
    print(f"wall {wall:.0f} s, {accepted / wall:.2f} accepted req/s; server counted "
          f"{server_counts['rejected']} rejected, {server_counts['length']} completed, "
          f"{server_counts['cancelled']} cancelled, {server_counts['error']} errors")
    print(f"RSS {rss_start / MIB:.1f} MiB at start, {sampler.peak.get('rss_bytes', 0) / MIB:.1f}"
          f" peak, {rss_end / MIB:.1f} at the end; {late_growth(sampler.timeline):+.1f} MiB over "
          f"the second half of the run (caches settle early; a leak keeps growing)")
    print(f"afterwards: {idle['pages_free']:.0f}/{idle['pages_total']:.0f} pages free, "
          f"{idle['preempt_ram_bytes']:.0f} parked bytes, {idle['requests_preempted']:.0f} "
          f"parked -> {'clean' if clean else 'NOT CLEAN'}")
    if slope is not None:
        print(f"RSS slope: {slope.mib_per_1000:+.2f} MiB per 1,000 distinct-prompt requests "
              f"(median of {DISTINCT_ROUNDS} rounds of {slope.num_requests // DISTINCT_ROUNDS}: "
              f"{slope.rounds}; limit {args.max_rss_slope:g}), {slope.num_failed} failed -> "
              f"{'flat' if flat else 'GROWING' if slope.num_failed == 0 else 'FAILED'}")
    for line in details:
        print("  ", line)
    write_json(args.out, {
        "config": {"model": args.model, "launch": args.launch, "preempt_every":
                   args.preempt_every, "clients": args.clients, "minutes": args.minutes,
                   "scale": args.scale, "seed": args.seed,
                   "distinct_requests": args.distinct_requests},
        "wall_seconds": wall, "outcomes": outcomes, "server_counts": server_counts,
        "parks": parks, "peak": sampler.peak, "budget_bytes": budget,
        "min_pages_free": sampler.min_pages_free, "samples": sampler.num_samples,
        "rss_bytes": {"start": rss_start, "peak": sampler.peak.get("rss_bytes"),
                      "end": rss_end},
        "rss_growth_second_half_mib": late_growth(sampler.timeline),
        "rss_slope": slope, "max_rss_slope_mib_per_1000": args.max_rss_slope, "flat": flat,
        "idle_after": idle, "clean": clean, "ok": ok, "details": details,
        "timeline": sampler.timeline,
    })
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
