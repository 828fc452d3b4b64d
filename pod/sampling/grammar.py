"""Grammar-constrained output through llguidance (JSON schemas, free JSON, llama.cpp's GBNF,
Lark): a `GrammarConstraint` per sequence implements `constraint.TokenConstraint`.

llguidance was picked by measurement (benchmarks/grammar_overhead.py, its numbers in
benchmarks/README.md) and has no dependencies (xgrammar requires transformers and triton). Its
tokenizer view is slow to build, so it is built once per tokenizer (per server) on first use;
compiled grammars are kept in an LRU cache and each sequence gets a copy.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from ..model.tokenizer import Tokenizer
from .grammar_check import (
    COMPILE_STACK_BYTES,
    GrammarChecker,
    GrammarError,
    TokenizerView,
    compile_matcher,
    run_with_stack,
)

log = logging.getLogger("kvpark.grammar")

CACHE_SIZE = 128  # compiled grammars kept (schemas repeat: one per client-side model class)
ANY_JSON_OBJECT = {"type": "object"}  # response_format json_object, as llama.cpp reads it
# llama.cpp's JSON whitespace: a space, or a newline and up to 20 blanks. Unbounded whitespace
# lets a weak model loop on it until max_tokens, with the JSON left unfinished.
JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n[ \t]{0,20})"}


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (its JSON text: the cache key) and what it was made from."""

    text: str
    source: str  # "json_schema", "gbnf", "regex" or "choice": for messages

    @classmethod
    def from_json_schema(cls, schema: Any) -> Grammar:
        try:  # a schema that is not JSON-serialisable never reaches here (it came from JSON)
            text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                 defaults=JSON_OPTIONS)
        except Exception as exc:  # llguidance refuses some shapes before compiling
            raise GrammarError(str(exc)) from exc
        return cls(text, "json_schema")

    @classmethod
    def from_gbnf(cls, gbnf: str) -> Grammar:
        """llama.cpp's GBNF, or Lark (llguidance's own syntax) when it reads as Lark."""
        try:
            lark = any_to_lark(gbnf)
        except Exception as exc:  # the converter raises plain errors for malformed rules
            raise GrammarError(f"not valid GBNF: {exc}") from exc
        return cls(llguidance.LLMatcher.grammar_from_lark(lark), "gbnf")

    @classmethod
    def from_regex(cls, regex: str) -> Grammar:
        """The whole output matches `regex` (vLLM's `structured_outputs.regex`)."""
        try:
            return cls(llguidance.LLMatcher.grammar_from_regex(regex), "regex")
        except Exception as exc:
            raise GrammarError(f"not a valid regular expression: {exc}") from exc

    @classmethod
    def from_choice(cls, choices: list[str]) -> Grammar:
        """The output is exactly one of `choices` (vLLM's `structured_outputs.choice`)."""
        # Lark's string literals take JSON's escapes
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
        return cls(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"), "choice")


class GrammarConstraint:
    """One sequence's place in its grammar. EOS is allowed only where the grammar may end."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_ids = sorted(eos_ids)
        self.bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        # logits: [model vocab], which may be padded past the tokenizer's ids
        if self.matcher.is_error():  # nothing is allowed any more: end it with EOS
            allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
            allowed[self.eos_ids] = True
        else:
            self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(),
                                                 self.bitmask.numel() * 4)
            bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")
            allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
            num = min(logits.shape[0], self.vocab_size)
            allowed[:num] = torch.from_numpy(bits[:num].astype(np.bool_))
        with torch.inference_mode():  # the model's logits are inference tensors
            logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            log.warning("token %d was not allowed by the grammar: %s", token,
                        self.matcher.get_error().splitlines()[0][:200])

    def is_done(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()


class Grammars:
    """A tokenizer's llguidance view (built once, on first use) and its compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self._lltok: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # requests are parsed on several worker threads
        self.view = TokenizerView(tokenizer.backend.to_str(), tokenizer.vocab_size,
                                  tuple(sorted(tokenizer.eos_token_ids)))
        self.checker = GrammarChecker(self.view)

    @property
    def lltok(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                self._lltok = self.view.build()
            return self._lltok

    def compile(self, grammar: Grammar) -> llguidance.LLMatcher:
        """The compiled grammar (a matcher at its start), or GrammarError. A grammar not seen
        before is compiled by the checking child first (`grammar_check`), then here on a
        thread with a larger stack."""
        with self._lock:
            if grammar.text in self._compiled:
                self._compiled.move_to_end(grammar.text)
                return self._compiled[grammar.text]
        self.checker.check(grammar.text, grammar.source)
        lltok = self.lltok
        matcher = run_with_stack(lambda: compile_matcher(lltok, grammar.text, grammar.source),
                                 COMPILE_STACK_BYTES)
        with self._lock:
            self._compiled[grammar.text] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh sequence's constraint; the grammar must have compiled (see `compile`)."""
        matcher = self.compile(grammar).deep_copy()
        return GrammarConstraint(matcher, self.tokenizer.vocab_size,
                                 self.tokenizer.eos_token_ids)


_by_tokenizer: dict[int, Grammars] = {}
_by_tokenizer_lock = threading.Lock()


def get_grammars(tokenizer: Tokenizer) -> Grammars:
    """The one `Grammars` of this tokenizer: a server has one tokenizer, so one per server."""
    with _by_tokenizer_lock:
        grammars = _by_tokenizer.get(id(tokenizer))
        if grammars is None or grammars.tokenizer is not tokenizer:
            grammars = _by_tokenizer[id(tokenizer)] = Grammars(tokenizer)
        return grammars
