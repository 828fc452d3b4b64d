"""Sampling: greedy, temperature, top-k, top-p, min-p, with a seeded generator per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: until EOS or the context ends
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    @property
    def is_greedy(self) -> bool:
        # below this temperature logits / t overflows float32; it is argmax in all but name.
        # top_p 0 keeps only the best token (llama.cpp's top-p keeps at least one)
        return (self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
                or self.top_p <= 0.0)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [vocab] float32 -> probabilities after temperature, top-k, top-p, min-p."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the first token)
        drop = (cumulative - sorted_probs) >= params.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 still keeps the best token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: [N, vocab] float32 -> one token id per row.

    One argmax serves every greedy row; only rows that draw at random are visited one by one,
    each with its own seeded generator.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            probs = filter_logits(logits[row], p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
