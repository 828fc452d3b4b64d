"""Logprobs in each API's shape: a token's text and UTF-8 bytes (`TokenNames`), OpenAI chat's
and completions', vLLM's prompt logprobs, llama.cpp's `completion_probabilities`."""

from __future__ import annotations

import math
from typing import Any

from ...model.tokenizer import Tokenizer
from ...sampling.sampler import TokenLogprob

MIN_LOGPROB = -9999.0  # what OpenAI and vLLM send for -inf (JSON has no infinity)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a vocabulary character -> the byte it stands for."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_OF = _byte_decoder()


class TokenNames:
    """A token's text and UTF-8 bytes, as logprobs show them (cached per request)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self.tokenizer.token_text(token_id)
            self._cache[token_id] = (text, self._bytes(token_id, text))
        return self._cache[token_id]

    def _bytes(self, token_id: int, text: str) -> list[int]:
        # a token that is part of a UTF-8 character decodes to U+FFFD; its bytes are in the
        # byte-level vocabulary entry (or a sentencepiece <0xNN> byte token)
        piece = self.tokenizer.backend.id_to_token(token_id) or ""
        if "\ufffd" in text and len(piece) == 6 and piece.startswith("<0x") and piece[-1] == ">":
            return [int(piece[3:5], 16)]
        if "\ufffd" in text and piece and all(ch in BYTE_OF for ch in piece):
            return [BYTE_OF[ch] for ch in piece]
        return list(text.encode("utf-8"))


class TokenIdNames(TokenNames):
    """vLLM's `return_tokens_as_token_ids`: tokens named `token_id:N` in logprobs, so a client
    can tell tokens apart whose text is not whole UTF-8."""

    def get(self, token_id: int) -> tuple[str, list[int]]:
        name = f"token_id:{token_id}"
        return name, list(name.encode())


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(names: TokenNames, entries: list[TokenLogprob]) -> dict[str, Any]:
    """OpenAI chat: `choice.logprobs`."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = names.get(token)
        return {"token": text, "logprob": _lp(logprob), "bytes": raw}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(names: TokenNames, entries: list[TokenLogprob], offset: int
                        ) -> dict[str, Any]:
    """OpenAI completions: `choice.logprobs`; `offset` is where the first token's text starts in
    the completion. As vLLM, each `top_logprobs` dict holds the k best and the sampled token."""
    tokens, offsets, tops = [], [], []
    for e in entries:
        text = names.get(e.token)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top = {names.get(t)[0]: _lp(lp) for t, lp in e.top}
        top.setdefault(text, _lp(e.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(names: TokenNames, prompt_ids: list[int], entries: list[TokenLogprob],
                    k: int) -> dict[str, Any]:
    """Completions' `echo` with `logprobs`: the prompt's tokens in `choice.logprobs`' shape,
    the first without a logprob (no row comes before it), each top cut to the `k` asked."""
    first = names.get(prompt_ids[0])[0]
    rest = completion_logprobs(names, [TokenLogprob(e.token, e.logprob, e.top[:k])
                                       for e in entries], len(first))
    return {"tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def joined_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    return {key: first[key] + (then[key] if then else []) for key in first}


def vllm_prompt_logprobs(names: TokenNames, entries: list[TokenLogprob]
                         ) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null), its own logprob and rank
    and the k most likely, keyed by token id."""
    def one(token: int, logprob: float, rank: int) -> tuple[str, dict[str, Any]]:
        return str(token), {"logprob": _lp(logprob), "rank": rank,
                            "decoded_token": names.get(token)[0]}

    shaped: list[dict[str, Any] | None] = [None]
    for e in entries:
        shaped.append(dict([one(t, lp, rank) for rank, (t, lp) in enumerate(e.top, 1)]
                           + [one(e.token, e.logprob, e.rank)]))
    return shaped


def llama_probabilities(names: TokenNames, entries: list[TokenLogprob],
                        post_sampling: bool = False) -> list[dict[str, Any]]:
    """llama.cpp /completion's `completion_probabilities`: logprobs of the model's own
    distribution, or with `post_sampling_probs` probabilities of the one the draw used (tokens
    the filters removed are left out of the tops)."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = names.get(token)
        value = {"prob": math.exp(logprob)} if post_sampling else {"logprob": _lp(logprob)}
        return {"id": token, "token": text, **value, "bytes": raw}

    tops = "top_probs" if post_sampling else "top_logprobs"
    return [{**one(e.token, e.logprob),
             tops: [one(t, lp) for t, lp in e.top if not (post_sampling and lp == -math.inf)]}
            for e in entries]
