"""Constrained decoding libraries on this CPU: compile time and per-token overhead.

    python benchmarks/grammar_overhead.py --tokens 200 --out results/grammar_overhead.json

With SmolLM2-135M's tokenizer (the GGUF's 49152-token vocabulary, built as the server builds
it), each installed library compiles a JSON schema with a few fields and free JSON (a
`json_object` request), then walks a fixed valid JSON document token by token: per token it
computes the mask of allowed tokens, applies it to a [vocab] float32 row (what the runner
does) and accepts the document's next token. The per-token figure is that walk's wall time
over its tokens; compile is the one-off time to a first usable matcher. A library that is not
installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from _kvpark_path import ensure_kvpark
from workload import print_table, write_json

ensure_kvpark()

from kvpark.pod.model.loader import builtin_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["math", "engines", "poetry", "notes"], "active": True}


@dataclass
class Walk:
    compile_ms: float
    per_token_us: float  # compute the mask + accept the token (the library's own work)
    apply_us: float  # the mask onto a [vocab] float32 row
    num_tokens: int


def walk(make: Callable[[], tuple[Callable, Callable, Callable]], ids: list[int], vocab: int,
         repeats: int) -> Walk:
    """`make()` -> (fill(), apply(row), accept(token)); compile timed once, the walk `repeats`
    times."""
    started = time.perf_counter()
    fill, apply, accept = make()
    compile_ms = (time.perf_counter() - started) * 1e3
    own, applying = [], []
    row = torch.zeros(vocab)
    for r in range(repeats):
        if r:
            fill, apply, accept = make()
        spent = applied = 0.0
        for token in ids:
            row.zero_()  # fresh logits each step, as the runner's
            t0 = time.perf_counter()
            fill()
            t1 = time.perf_counter()
            apply(row)
            t2 = time.perf_counter()
            assert row[token] == 0, f"the document's token {token} was masked"
            accept(token)
            spent += (t1 - t0) + (time.perf_counter() - t2)
            applied += t2 - t1
        own.append(spent / len(ids) * 1e6)
        applying.append(applied / len(ids) * 1e6)
    return Walk(compile_ms, statistics.median(own), statistics.median(applying), len(ids))


def apply_bitmask(row: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf where the bit of a token is 0 (llguidance's own apply is a torch.compile kernel,
    which on a CPU would compile C++ at first use)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:row.shape[0]]
    row.masked_fill_(torch.from_numpy(bits == 0), float("-inf"))


def llguidance_cases(tokenizer, vocab: int) -> dict[str, Callable]:
    import llguidance
    import llguidance.torch as llt

    started = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                   eos_token=tokenizer.eos_token_id)
    info_ms = (time.perf_counter() - started) * 1e3
    bitmask = llt.allocate_token_bitmask(1, vocab)

    def make(grammar: str) -> Callable:
        def build():
            matcher = llguidance.LLMatcher(lltok, grammar)

            def fill():
                llt.fill_next_token_bitmask(matcher, bitmask, 0)

            def accept(token):
                assert matcher.consume_token(token), matcher.get_error()
            return fill, lambda row: apply_bitmask(row, bitmask[0]), accept
        return build

    schema = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    free = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    return {"info_ms": info_ms, "version": llguidance.__version__ if hasattr(
        llguidance, "__version__") else _version("llguidance"),
        "schema": make(schema), "free": make(free)}


def xgrammar_cases(tokenizer, vocab: int) -> dict[str, Callable]:
    import xgrammar as xgr

    started = time.perf_counter()
    encoded = [tokenizer.backend.id_to_token(i) or "" for i in range(vocab)]
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))
    info_ms = (time.perf_counter() - started) * 1e3
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def make(compile_: Callable) -> Callable:
        def build():
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            matcher = xgr.GrammarMatcher(compile_(compiler))

            def fill():
                matcher.fill_next_token_bitmask(bitmask)

            def accept(token):
                assert matcher.accept_token(token)
            return fill, lambda row: xgr.apply_token_bitmask_inplace(row, bitmask[0]), accept
        return build

    return {"info_ms": info_ms, "version": _version("xgrammar"),
            "schema": make(lambda c: c.compile_json_schema(json.dumps(SCHEMA))),
            "free": make(lambda c: c.compile_builtin_json_grammar())}


def outlines_core_cases(tokenizer, vocab: int) -> dict[str, Callable]:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    started = time.perf_counter()
    eos = tokenizer.eos_token_id
    by_text: dict[bytes, list[int]] = {}
    unbyte = {c: b for b, c in _bytes_to_unicode().items()}  # byte-level BPE's letters
    for i in range(vocab):
        text = tokenizer.backend.id_to_token(i)
        if i != eos and text is not None:
            raw = bytes(unbyte[c] for c in text) if all(c in unbyte for c in text) else (
                text.encode())
            by_text.setdefault(raw, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, by_text)
    info_ms = (time.perf_counter() - started) * 1e3

    def make(regex: str) -> Callable:
        def build():
            guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
            bitmask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

            def fill():
                guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

            def accept(token):
                guide.advance(token)
            return fill, lambda row: apply_bitmask(row, bitmask), accept
        return build

    # free JSON is recursive: no regex holds it; outlines-core's regex for {"type": "object"}
    # (bounded nesting) stands in for it
    free = build_regex_from_schema(json.dumps({"type": "object"}))
    return {"info_ms": info_ms, "version": _version("outlines_core"),
            "schema": make(build_regex_from_schema(json.dumps(SCHEMA))), "free": make(free)}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable letter map, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


LIBRARIES = {"llguidance": llguidance_cases, "xgrammar": xgrammar_cases,
             "outlines-core": outlines_core_cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="results/grammar_overhead.json")
    p.add_argument("--only", nargs="*", default=list(LIBRARIES))
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = builtin_tokenizer()
    vocab = tokenizer.vocab_size
    # the document as the model would write it: compact JSON, tokenised as output text
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_bos=False)
    rows, results = [], {}
    for name in args.only:
        try:
            cases = LIBRARIES[name](tokenizer, vocab)
        except ImportError as exc:
            results[name] = {"error": f"not installed: {exc}"}
            rows.append([name, "-", "not installed", "", "", "", "", "", ""])
            continue
        entry = {"version": cases["version"], "tokenizer_info_ms": cases["info_ms"]}
        for case in ("schema", "free"):
            try:
                entry[case] = walk(cases[case], ids, vocab, args.repeats).__dict__
            except Exception as exc:  # a library that cannot do the case says so in the table
                entry[case] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name] = entry
        rows.append([name, entry["version"], f"{entry['tokenizer_info_ms']:.0f}",
                     *_cells(entry["schema"]), *_cells(entry["free"])])
    print(f"vocab {vocab}, document {len(ids)} tokens, median of {args.repeats} walks")
    print_table(["library", "version", "tokenizer ms", "schema compile ms", "schema us/tok",
                 "apply us/tok", "free compile ms", "free us/tok", "apply us/tok"], rows)
    write_json(args.out, {"vocab": vocab, "num_tokens": len(ids), "results": results})


def _cells(case: dict) -> list[str]:
    if "error" in case:
        return [case["error"][:40], "", ""]
    return [f"{case['compile_ms']:.1f}", f"{case['per_token_us']:.0f}",
            f"{case['apply_us']:.0f}"]


if __name__ == "__main__":
    main()
