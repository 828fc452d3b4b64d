"""Shared pieces of the benchmarks: prompts, a streaming chat client, and result output."""

from __future__ import annotations

import json
import ssl
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
from serverproc import ServerProcess, parse_metrics  # noqa: E402,F401
from texts import LIGHTHOUSE  # noqa: E402,F401  (a passage to copy: tests/server/texts.py)

# One TLS context for every request the benchmarks time (`verify=TLS`). Without it each
# `httpx.stream` builds its own, loading the CA bundle even for http:// under the GIL: tens of
# milliseconds a request, over a second for 32 chats started at once, all of it counted in the
# time to first token of whichever server was being measured.
TLS = ssl.create_default_context()

TOPICS = ["the history of bread", "how tides work", "the life of honeybees",
          "building a wooden boat", "the rules of chess", "why the sky is blue",
          "how compilers work", "the water cycle"]
PARAGRAPH = ("Here are some notes to read carefully before answering. They describe, in plain "
             "words, a long afternoon spent walking along a river, the birds that were seen, the "
             "weather as it changed, and the small boats that passed by one after another. ")


def long_prompt(index: int, approx_tokens: int, salt: str = "") -> str:
    """About `approx_tokens` tokens of context followed by a question (~50 tokens/paragraph).

    Prompts share everything but the question; a `salt` puts a distinct first line in front, so
    a server with a prompt cache (llama-server reuses a slot's KV for a common prefix) computes
    every prompt in full, as kvpark does.
    """
    paragraphs = max(1, approx_tokens // 50)
    topic = TOPICS[index % len(TOPICS)]
    head = f"Notes, batch {salt}, reader {index}:\n" if salt else ""
    return (head + PARAGRAPH * paragraphs
            + f"\nNow, ignoring the notes, write a long essay about {topic}.")


@dataclass
class ChatResult:
    ok: bool
    completion_tokens: int
    text: str
    error: str | None
    seconds: float
    ttft: float | None = None  # seconds to the first text
    itl: list[float] = field(default_factory=list)  # seconds between consecutive text chunks


def stream_chat(base_url: str, prompt: str, max_tokens: int, timeout: float = 1800,
                ignore_eos: bool = True) -> ChatResult:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "seed": 1234,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    started = time.perf_counter()
    text, tokens, error = [], 0, None
    arrivals: list[float] = []  # of each chunk with text: one token each, bar held-back text
    try:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                          timeout=timeout, verify=TLS) as response:
            if response.status_code != 200:
                response.read()
                return ChatResult(False, 0, "", response.text, time.perf_counter() - started)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                for choice in chunk.get("choices", []):
                    content = choice.get("delta", {}).get("content") or ""
                    if content:
                        arrivals.append(time.perf_counter())
                    text.append(content)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return ChatResult(error is None, tokens, "".join(text), error,
                      time.perf_counter() - started,
                      arrivals[0] - started if arrivals else None, gaps(arrivals))


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_json(path: str | Path, payload: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o)))
    print(f"\nwrote {path}")


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
