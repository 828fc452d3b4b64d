"""A request's sampling fields as `SamplingParams`: temperature and the other filters, the
output limit (read by the API's names from `fields`), stop strings, penalties, `logit_bias`,
logprobs in each API's shape. Each field's bounds are `fields`', which the OpenAPI document
states too."""

from __future__ import annotations

import re
from typing import Any

from ..model.tokenizer import Tokenizer
from ..sampling.sampler import SamplingParams
from .errors import bad_field as _bad
from .errors import shown
from .field_values import boolean_field, integer_field, ranged_field
from .fields import (
    MAX_BIAS,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    NO_LIMIT,
    UNLIMITED_AT_NO_LIMIT,
)


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop", "expected a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise _bad("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")
    return tuple(s for s in value if s)


def _max_tokens(body: dict, names: tuple[str, ...], max_context: int) -> int | None:
    """The first limit name sent wins; a later one is not read, but held to its type."""
    given = [name for name in names if body.get(name) is not None]
    for name in given[1:]:
        integer_field(body, name, None, -(1 << 62), 1 << 62)
    for name in given:
        if body.get(name) is not None:
            value = body[name]
            if name in UNLIMITED_AT_NO_LIMIT and type(value) is int and value == NO_LIMIT:
                return None
            return integer_field(body, name, None, 1, max_context)
    return None


def sampling_params(body: dict, max_context: int, max_tokens_names: tuple[str, ...],
                    tokenizer: Tokenizer | None = None, kind: str = "completion"
                    ) -> SamplingParams:
    seed = ranged_field(body, "seed", None)
    top_k = ranged_field(body, "top_k", 0)
    max_tokens = _max_tokens(body, max_tokens_names, max_context)
    min_tokens = int(ranged_field(body, "min_tokens", 0, max_tokens or max_context))
    return SamplingParams(
        temperature=ranged_field(body, "temperature", 1.0),
        top_p=ranged_field(body, "top_p", 1.0),  # 0: greedy (is_greedy)
        top_k=0 if top_k in (None, -1) else top_k,  # llama.cpp's -1: off
        min_p=ranged_field(body, "min_p", 0.0),
        seed=None if seed == -1 else seed,  # llama.cpp's -1: random
        max_tokens=max_tokens,
        stop=_stops(body),
        ignore_eos=boolean_field(body, "ignore_eos", False),
        n=int(ranged_field(body, "n", 1)),
        presence_penalty=ranged_field(body, "presence_penalty", 0.0),
        frequency_penalty=ranged_field(body, "frequency_penalty", 0.0),
        repetition_penalty=_positive(body, "repetition_penalty"),
        repeat_penalty=_positive(body, "repeat_penalty"),
        repeat_last_n=int(ranged_field(body, "repeat_last_n", 64, max_context)),
        logit_bias=_logit_bias(body, tokenizer),
        min_tokens=min_tokens,
        # vLLM: min_tokens holds back every end-of-generation id
        eos_ids=tokenizer.eos_token_ids if tokenizer is not None and min_tokens else frozenset(),
        logprobs=_logprobs(body, kind),
        prompt_logprobs=_prompt_logprobs(body, kind),
        post_sampling_probs=kind == "llama" and boolean_field(body, "post_sampling_probs", False),
    )


def _positive(body: dict, name: str) -> float:
    """A multiplicative penalty: 1 is off (vLLM takes any value above 0)."""
    return ranged_field(body, name, 1.0)


def _logit_bias(body: dict, tokenizer: Tokenizer | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}, or llama.cpp's [[id, bias], ...]; bias -100..100, or
    false (llama.cpp: never this token). As llama.cpp, a key that is text, not an id, stands
    for each token the text is made of."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, (dict, list)):
        raise _bad("logit_bias", "expected an object of token id -> bias, or a list of "
                   "[token id, bias] pairs")
    if len(value) > MAX_LOGIT_BIAS:  # before any work per entry
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    if isinstance(value, dict):
        pairs = list(value.items())
    elif all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise _bad("logit_bias", "expected an object of token id -> bias, or a list of "
                   "[token id, bias] pairs")
    entries: list[tuple[Any, Any]] = []
    for key, bias in pairs:  # text keys tokenised until the bound is passed, not beyond
        entries.extend((token, bias) for token in _bias_tokens(key, tokenizer))
        if len(entries) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"the texts make more than {MAX_LOGIT_BIAS} tokens")
    vocab_size = tokenizer.vocab_size if tokenizer is not None else 1 << 31
    return tuple(_bias_entry(token, bias, vocab_size) for token, bias in entries)


def _bias_tokens(key: Any, tokenizer: Tokenizer | None) -> list[Any]:
    """A key's token ids: itself, or the tokens of a text key (left as is when it is neither:
    `_bias_entry` names it)."""
    if (isinstance(key, str) and key and not re.fullmatch(r"-?[0-9]+", key)
            and tokenizer is not None and len(key) <= MAX_STOP_CHARS):
        return tokenizer.encode(key, False) or [key]
    return [key]


def _bias_entry(key: Any, bias: Any, vocab_size: int) -> tuple[int, float]:
    token = key if isinstance(key, int) and not isinstance(key, bool) else None
    if isinstance(key, str) and re.fullmatch(r"[0-9]{1,10}", key):
        token = int(key)
    if token is None or not 0 <= token < vocab_size:
        raise _bad("logit_bias", f"token ids must be integers in [0, {vocab_size}), got "
                   f"{shown(key)}")
    if bias is False:
        return token, float("-inf")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
            -MAX_BIAS <= bias <= MAX_BIAS):
        raise _bad("logit_bias", f"a bias must be a number in [-{MAX_BIAS}, {MAX_BIAS}] (or "
                   f"false), got {shown(bias)} for token {token}")
    return token, float(bias)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token (None: no logprobs). Chat: `logprobs` true plus
    `top_logprobs`; completions: `logprobs` k; llama.cpp: `n_probs` k (0: none)."""
    if kind == "chat":
        wanted = boolean_field(body, "logprobs", False)
        top = ranged_field(body, "top_logprobs", None)
        if top and not wanted:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        return (top or 0) if wanted else None
    if kind == "completion":
        return integer_field(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    return ranged_field(body, "n_probs", 0) or None


def _prompt_logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per prompt token (None: no prompt logprobs): vLLM's
    `prompt_logprobs` k, or completions' `echo` with `logprobs` (the prompt's rows are part of
    the echoed logprobs), whichever asks for more."""
    if kind == "llama":
        return None
    asked = ranged_field(body, "prompt_logprobs", None)
    if kind == "completion" and boolean_field(body, "echo", False):
        echoed = integer_field(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
        if echoed is not None:
            return max(asked or 0, echoed)
    return asked
