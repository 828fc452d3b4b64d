"""Each API's request fields in one table: which fields a route takes, and what each API calls
the setting they name differently, the output-length limit (OpenAI's `max_tokens`, chat's newer
`max_completion_tokens`, llama.cpp's `n_predict`); and the bounds of the fields (`seed`, `stop`,
`temperature` ...), which every API shares.

The parsers read bodies by this table, the OpenAPI document describes it and the admission check
quotes it, so a field's name or bound is written here once. An API is named by the `kind` of the
request it makes: "chat", "completion" (OpenAI's /v1/completions) or "llama" (llama.cpp's
/completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ---- names: which fields each API takes, and what it calls them ---------------------------------

# OpenAI (and llama.cpp) fields not implemented here, with the values that ask for nothing. Any
# other value is refused: a client that asked for JSON, a tool call or logprobs must not get
# plain text back as if it had.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
}
# Accepted and without effect on the output: clients send them by default. Each is still held to
# the type OpenAI (or llama.cpp, for `cache_prompt`) gives it, so a client's mistake is a 400
# there and here alike.
HARMLESS: dict[str, str] = {
    "user": "string", "safety_identifier": "string", "metadata": "metadata",
    "store": "boolean", "service_tier": "string", "parallel_tool_calls": "boolean",
    "prompt_cache_key": "string", "prompt_cache_retention": "string",
    "prompt_cache_options": "object", "cache_prompt": "boolean"}
# OpenAI's `metadata`: up to 16 pairs of a key of at most 64 characters and a string value of at
# most 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
SAMPLING = frozenset({"model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                      "ignore_eos", "n", "stream", "stream_options", "priority", "return_progress",
                      "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "repeat_penalty", "repeat_last_n", "logit_bias", "min_tokens"})
STRUCTURED = frozenset({"response_format", "grammar", "json_schema", "structured_outputs",
                        "guided_json", "guided_regex", "guided_choice", "guided_grammar"})

# a reasoning model's fields (chat's): the template's variables, how the think block is
# returned, its budget (`reasoning_fields.py`)
REASONING = frozenset({"chat_template_kwargs", "reasoning_effort", "reasoning_format",
                       "reasoning_budget_tokens", "thinking_budget_tokens",
                       "reasoning_budget_message"})

# The output-length limit's name in every API: server-wide defaults are laid under it, and
# /props reports what a request that sets nothing gets through it.
COMMON_MAX_TOKENS = "max_tokens"
# Names whose -1 means no limit (llama.cpp's). Their 0 is refused like any other name's:
# llama.cpp still generates one token for it (its limit is checked after a token), and its
# older servers none.
NO_LIMIT = -1
UNLIMITED_AT_NO_LIMIT = frozenset({"n_predict"})


@dataclass(frozen=True)
class ApiFields:
    """One API's fields."""

    limit_names: tuple[str, ...]  # the output-length limit's names: the first one sent wins
    quoted_limit: str  # the name an error about the limit gives
    own: frozenset[str]  # what this API takes beyond the shared fields and the limit

    @property
    def known(self) -> frozenset[str]:
        """Every field this API reads; the rest are ignored (and logged)."""
        return SAMPLING | frozenset(HARMLESS) | STRUCTURED | self.own | frozenset(self.limit_names)


API_FIELDS: dict[str, ApiFields] = {
    "chat": ApiFields(
        limit_names=("max_completion_tokens", COMMON_MAX_TOKENS),
        quoted_limit=COMMON_MAX_TOKENS,
        own=frozenset({"messages", "tools", "tool_choice", "logprobs", "top_logprobs",
                       "prompt_logprobs", "add_generation_prompt", "continue_final_message",
                       "return_tokens_as_token_ids", "echo", *REASONING})),
    "completion": ApiFields(
        limit_names=(COMMON_MAX_TOKENS,),
        quoted_limit=COMMON_MAX_TOKENS,
        own=frozenset({"prompt", "logprobs", "echo", "prompt_logprobs",
                       "return_tokens_as_token_ids"})),
    "llama": ApiFields(
        limit_names=("n_predict", COMMON_MAX_TOKENS),
        quoted_limit="n_predict",
        own=frozenset({"prompt", "return_tokens", "n_probs", "post_sampling_probs"})),
}


# ---- bounds: the same in every API that takes the field -----------------------------------------

MAX_N = 16
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 1024  # per stop string: up to this much text is held back while it may match
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
MAX_N_PROBS = 100  # llama.cpp's n_probs
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BIAS = 100  # a logit_bias value's size (OpenAI's)
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range is -2..2
# multiplicative penalties: far outside this a logit divided by one overflows float32
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


@dataclass(frozen=True)
class Range:
    """A numeric field's bounds, the same in every API that takes it."""

    type: str  # "integer" or "number", as JSON Schema names them
    lo: float
    hi: float | None = None  # None: the request's context, in tokens

    def bounds(self, max_context: int) -> tuple[float, float]:
        return self.lo, max_context if self.hi is None else self.hi


# Written as the OpenAPI document states them (0, not 0.0); a number field's error message
# shows them as floats either way.
RANGES: dict[str, Range] = {
    "temperature": Range("number", 0, 2),
    "top_p": Range("number", 0, 1),
    "min_p": Range("number", 0, 1),
    "top_k": Range("integer", -1, 1 << 20),  # -1: off (llama.cpp's)
    "seed": Range("integer", -1, 2**63 - 1),  # -1: random (llama.cpp's)
    "n": Range("integer", 1, MAX_N),
    "priority": Range("integer", -(2**31), 2**31 - 1),
    "presence_penalty": Range("number", -MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Range("number", -MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Range("number", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "repeat_penalty": Range("number", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    "repeat_last_n": Range("integer", -1),  # -1: the whole context (llama.cpp's)
    "min_tokens": Range("integer", 0),  # and no more than the output limit, when one is set
    "top_logprobs": Range("integer", 0, MAX_TOP_LOGPROBS),
    "prompt_logprobs": Range("integer", 0, MAX_TOP_LOGPROBS),
    "n_probs": Range("integer", 0, MAX_N_PROBS),
}
