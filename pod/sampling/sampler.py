"""Sampling: logits processing (penalties, logit bias, min_tokens), then greedy, temperature,
top-k, top-p, min-p with a seeded generator per request; and the logprobs a request asked for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvpark.kernels.argmax import row_argmax

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
    # logits processing, applied to a row before the filters and the draw
    presence_penalty: float = 0.0  # OpenAI: over generated tokens, once per distinct token
    frequency_penalty: float = 0.0  # OpenAI: over generated tokens, per occurrence
    repetition_penalty: float = 1.0  # vLLM / HF: over prompt + generated tokens
    repeat_penalty: float = 1.0  # llama.cpp: over the last `repeat_last_n` context tokens
    repeat_last_n: int = 64  # llama.cpp: -1 the whole context, 0 off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans
    min_tokens: int = 0  # EOS (`eos_ids`) and stop strings cannot end the output before this
    eos_ids: frozenset[int] = frozenset()  # masked while fewer than min_tokens were generated
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely
    # None: none; k: each prompt token's logprob (after the first) and the k most likely there
    prompt_logprobs: int | None = None
    # llama.cpp's post_sampling_probs: logprobs of the distribution the draw used (after the
    # penalties, the bias, the grammar, temperature and the filters) instead of the raw model's
    post_sampling_probs: bool = False
    needs_processing: bool = field(init=False, repr=False, compare=False)
    is_plain: bool = field(init=False, repr=False, compare=False)  # no processing, no logprobs

    def __post_init__(self) -> None:
        # computed once: the runner asks them of every row on every step
        object.__setattr__(self, "needs_processing", bool(
            self.presence_penalty or self.frequency_penalty or self.logit_bias
            or self.repetition_penalty != 1.0 or self.min_tokens
            or (self.repeat_penalty != 1.0 and self.repeat_last_n != 0)))
        object.__setattr__(self, "is_plain", not self.needs_processing and self.logprobs is None)

    @property
    def scores_only(self) -> bool:
        """An output limit of 0 (`echo` scoring a prompt): nothing is generated."""
        return self.max_tokens == 0

    def tokens_left(self, num_generated: int) -> int | None:
        """How many more tokens the output limit allows (None: no limit)."""
        return None if self.max_tokens is None else self.max_tokens - num_generated

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


# ---- logits processing (pure: a new row each, the input untouched) ---------------------------

def apply_repetition(row: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    """HF / vLLM / llama.cpp: a seen token's logit is divided by `penalty` if positive and
    multiplied by it if negative (> 1 discourages repeats)."""
    if penalty == 1.0 or not ids:
        return row
    seen = torch.tensor(sorted(set(ids)), dtype=torch.long)
    values = row[seen]
    row = row.clone()
    row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    return row


def apply_presence_frequency(row: torch.Tensor, generated: list[int], presence: float,
                             frequency: float) -> torch.Tensor:
    """OpenAI: logit -= frequency x count + presence x (count > 0), over generated tokens."""
    if not generated or (presence == 0.0 and frequency == 0.0):
        return row
    ids, counts = torch.unique(torch.tensor(generated, dtype=torch.long), return_counts=True)
    row = row.clone()
    row[ids] -= frequency * counts.to(row.dtype) + presence
    return row


def apply_logit_bias(row: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    if not bias:
        return row
    ids, values = zip(*bias)
    # index_add: a token named twice (llama.cpp's list form) gets both biases
    return row.index_add(0, torch.tensor(ids, dtype=torch.long),
                         torch.tensor(values, dtype=row.dtype))


def apply_min_tokens(row: torch.Tensor, num_generated: int, params: SamplingParams
                     ) -> torch.Tensor:
    if num_generated >= params.min_tokens or not params.eos_ids:
        return row
    row = row.clone()
    row[torch.tensor(sorted(params.eos_ids), dtype=torch.long)] = float("-inf")
    return row


def repeat_window(tokens: list[int], last_n: int) -> list[int]:
    """llama.cpp's penalty window: the last `last_n` tokens of the context (-1: all, 0: none)."""
    if last_n == 0:
        return []
    return tokens if last_n < 0 else tokens[-last_n:]


def process_logits(row: torch.Tensor, params: SamplingParams, tokens: list[int],
                   num_prompt: int) -> torch.Tensor:
    """row: [vocab] float32 raw logits of a sequence whose context is `tokens` (prompt first,
    `num_prompt` long) -> the logits its filters and draw see. vLLM's order: bias and
    min_tokens, then the penalties. Counts come from `tokens`, which a park (swap or
    recompute) keeps as it is: the state is the same after any park."""
    generated = tokens[num_prompt:]
    row = apply_logit_bias(row, params.logit_bias)
    row = apply_min_tokens(row, len(generated), params)
    row = apply_repetition(row, tokens, params.repetition_penalty)
    row = apply_repetition(row, repeat_window(tokens, params.repeat_last_n),
                           params.repeat_penalty)
    return apply_presence_frequency(row, generated, params.presence_penalty,
                                    params.frequency_penalty)


# ---- the draw ----------------------------------------------------------------------------------

# top-p's candidates before a full sort: the prefix it keeps ends among them when they hold
# top_p of the mass (top-k of 256 of a 49k vocabulary is ~30x cheaper than its sort)
TOP_P_CANDIDATES = 256


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
        sorted_probs, order = most_likely_first(probs, params.top_p)
        cumulative = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the first token)
        drop = (cumulative - sorted_probs) >= params.top_p
        drop[0] = False  # a top_p that rounds to 0 in float32 still keeps the best token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs / probs.sum()


def most_likely_first(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities in descending order and their token ids, as far as top-p can reach:
    the `TOP_P_CANDIDATES` largest when they hold `top_p` of the mass or every non-zero one
    (the prefix top-p keeps ends among them, and their running sum is the full sort's), else
    all of them (a full sort of a vocabulary costs milliseconds on the CPU)."""
    if probs.shape[-1] > TOP_P_CANDIDATES:
        values, order = torch.topk(probs, TOP_P_CANDIDATES)
        if float(values.sum()) >= top_p or float(values[-1]) == 0.0:
            return values, order
    return torch.sort(probs, descending=True)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` [vocab] (non-negative weights) by inverse CDF: a uniform u in
    [0, 1) from the sequence's generator, the first token whose running sum (float64) passes
    u * the total. A token of weight 0 is never drawn (its running sum equals the one before).
    torch.multinomial drew the same way in about 20x the time on a 49k vocabulary."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator)
    token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if token >= probs.shape[0]:  # u * total rounded up to the total: the last token with weight
        token = int(probs.nonzero()[-1])
    return token


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> list[int]:
    """logits: [N, vocab] float32 -> one token id per row.

    One argmax serves every greedy row; only rows that draw at random are visited one by one,
    each with its own seeded generator.
    """
    tokens = row_argmax(logits)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            tokens[row] = draw(filter_logits(logits[row], p), gen)
    return tokens


# ---- logprobs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the `k` most likely alternatives at its step."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int = 0  # 1 = the most likely token; 0: not computed (sampled tokens)


class Sampled(NamedTuple):
    """What the runner hands the engine for one sequence of a step."""

    token: int
    logprob: TokenLogprob | None = None  # only when the request asked for logprobs


def get_logprob(raw_logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """raw_logprobs: [vocab] log_softmax of the model's raw logits. Like vLLM's default
    ("raw_logprobs") they describe the model, before penalties, bias, temperature and the
    filters, so they do not change with the sampling settings."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(raw_logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(raw_logprobs[token]), top)


def post_sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [vocab] after processing and masking -> log of the probabilities the draw used:
    the filters' distribution, or all mass on the argmax for a greedy request."""
    if params.is_greedy:
        chosen = torch.full_like(logits, float("-inf"))
        chosen[int(logits.argmax())] = 0.0
        return chosen
    return torch.log(filter_logits(logits, params))


def get_prompt_logprob(raw_logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """A prompt token's logprob from the row before it, with its rank (vLLM's
    `prompt_logprobs`): 1 + how many tokens the model found more likely."""
    rank = int((raw_logprobs > raw_logprobs[token]).sum()) + 1
    return dataclasses.replace(get_logprob(raw_logprobs, token, k), rank=rank)


class DraftSeed(NamedTuple):
    """The MTP head's output at a sequence's last computed position: its guess of the token
    after the next, and the hidden state the next link of its chain reads (`model/mtp.py`)."""

    position: int
    token: int
    hidden: torch.Tensor  # [hidden] on the model's device


class ChunkOutput(NamedTuple):
    """What the runner hands the engine for one planned chunk of a sequence."""

    sampled: Sampled | None = None  # when the chunk reached the end of what was fed
    # the logprobs of the prompt tokens this chunk's rows predict (prompt_logprobs requests)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # speculation: the tokens sampled after `sampled` at its draft rows, in order; all but the
    # last matched the draft (len(verified) draft tokens were accepted)
    verified: tuple[Sampled, ...] = ()
    mtp_seed: DraftSeed | None = None  # draft-mtp: the head's first guess for the next step
