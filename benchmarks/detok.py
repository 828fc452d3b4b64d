"""Streaming detokenizers compared: kvpark's hand-written IncrementalDetokenizer against
`tokenizers.decoders.DecodeStream` (what pod/core/text_output.py uses), per token, with the default
model's tokenizer.

    python benchmarks/detok.py --tokens 30000 --out benchmarks/results/detok.json

The text mixes English prose, code, German, Russian, Chinese, Japanese, Korean, Arabic, emoji
(with skin tones and ZWJ sequences), plus stretches of random token ids (which split UTF-8
characters anywhere) and special tokens. A mismatch is a token after which the two emitted
different text; "final text" compares everything emitted, flush included.
"""

from __future__ import annotations

import argparse
import random
import time

from workload import print_table, write_json

from kvpark.pod.core.text_output import StreamDetokenizer
from kvpark.pod.model.loader import builtin_tokenizer
from kvpark.pod.model.tokenizer import IncrementalDetokenizer

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst "
    "of times; it was the age of wisdom, it was the age of foolishness.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
    "for i in range(10):\n\tprint(f\"{i:>3} {fib(i)}\")  # tabs, braces {}\n",
    "Größenordnung, Übermaß, Straße und Äpfel: die Bärenhöhle liegt südöstlich.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "我能吞下玻璃而不伤身体。机器学习模型的推理服务器需要高效的键值缓存。",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ。日本語のテキスト。",
    "다람쥐 헌 쳇바퀴에 타고파. 한국어 문장입니다.",
    "نص عربي للاختبار مع بعض الكلمات.",
    "Emoji: 🦙🚀🔥 👍🏽 👩‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇩🇪🇯🇵 — “quotes” ‘single’ … ½ × ÷ € ™",
    "Math: ∀x ∈ ℝ, ∃y: x² + y² ≥ 0; ∑ᵢ aᵢ ≈ ∫ f(x) dx. Arrows → ⇒ ↔.",
    "<|im_start|>assistant\nSure!<|im_end|>",
]


def corpus_ids(tokenizer, num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        if rng.random() < 0.1:  # random ids: partial UTF-8 sequences anywhere
            ids += [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 20))]
        else:
            ids += tokenizer.encode(rng.choice(SAMPLES) + rng.choice([" ", "\n", "", "\n\n"]))
    return ids[:num_tokens]


def run(make, ids: list[int]) -> tuple[list[str], float]:
    detok = make()
    pieces = []
    started = time.perf_counter()
    for token in ids:
        pieces.append(detok.push(token))
    pieces.append(detok.flush())
    return pieces, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=30000)
    p.add_argument("--seqs", type=int, default=30, help="the tokens are split into this many "
                   "sequences (a detokenizer per sequence, as in serving)")
    p.add_argument("--repeats", type=int, default=3, help="timing: the best of this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/detok.json")
    args = p.parse_args()
    tokenizer = builtin_tokenizer()
    ids = corpus_ids(tokenizer, args.tokens, args.seed)
    size = -(-len(ids) // args.seqs)
    seqs = [ids[i:i + size] for i in range(0, len(ids), size)]
    makers = {"hand-written (IncrementalDetokenizer)": lambda: IncrementalDetokenizer(tokenizer),
              "tokenizers DecodeStream": lambda: StreamDetokenizer(tokenizer)}
    outputs: dict[str, list[list[str]]] = {}
    seconds: dict[str, float] = {}
    for name, make in makers.items():
        best = float("inf")
        for _ in range(args.repeats):
            runs = [run(make, seq) for seq in seqs]
            best = min(best, sum(t for _, t in runs))
        outputs[name] = [pieces for pieces, _ in runs]
        seconds[name] = best
    (a, ours), (b, theirs) = outputs.items()
    token_mismatches = sum(x != y for sa, sb in zip(ours, theirs) for x, y in zip(sa, sb))
    text_mismatches = sum("".join(sa) != "".join(sb) for sa, sb in zip(ours, theirs))
    reference = sum("".join(sa) != tokenizer.decode(seq) for sa, seq in zip(theirs, seqs))
    rows = [[name, f"{seconds[name] / len(ids) * 1e6:.1f}"] for name in makers]
    print(f"{len(ids)} tokens in {len(seqs)} sequences, best of {args.repeats}")
    print_table(["detokenizer", "us per token"], rows)
    print(f"per-token output differs after {token_mismatches} of {len(ids)} tokens; final text "
          f"differs in {text_mismatches} of {len(seqs)} sequences; DecodeStream's final text "
          f"differs from a whole decode in {reference}")
    write_json(args.out, {"args": vars(args), "num_tokens": len(ids),
                          "us_per_token": {n: seconds[n] / len(ids) * 1e6 for n in makers},
                          "token_mismatches": token_mismatches,
                          "text_mismatches": text_mismatches,
                          "decode_stream_vs_whole_decode": reference,
                          "speedup": seconds[a] / seconds[b]})


if __name__ == "__main__":
    main()
