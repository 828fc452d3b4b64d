"""Each API's request fields in one table: which fields a route takes, and what each API calls
the setting they name differently, the output-length limit (OpenAI's `max_tokens`, chat's newer
`max_completion_tokens`, llama.cpp's `n_predict`).

The parsers read bodies by this table, the OpenAPI document describes it and the admission check
quotes it, so a field's name is written here once. An API is named by the `kind` of the request
it makes: "chat", "completion" (OpenAI's /v1/completions) or "llama" (llama.cpp's /completion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
# Accepted and without effect on the output: clients send them by default.
HARMLESS = frozenset({"user", "safety_identifier", "metadata", "store", "service_tier",
                      "parallel_tool_calls", "prompt_cache_key", "prompt_cache_retention",
                      "prompt_cache_options", "cache_prompt"})
SAMPLING = frozenset({"model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                      "ignore_eos", "n", "stream", "stream_options", "priority", "return_progress",
                      "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "repeat_penalty", "repeat_last_n", "logit_bias", "min_tokens"})
STRUCTURED = frozenset({"response_format", "grammar", "json_schema", "structured_outputs",
                        "guided_json", "guided_regex", "guided_choice", "guided_grammar"})

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

    max_tokens: tuple[str, ...]  # the output-length limit's names: the first one sent wins
    quoted_max_tokens: str  # the name an error about the limit gives
    own: frozenset[str]  # what this API takes beyond the shared fields and `max_tokens`

    @property
    def known(self) -> frozenset[str]:
        """Every field this API reads; the rest are ignored (and logged)."""
        return SAMPLING | HARMLESS | STRUCTURED | self.own | frozenset(self.max_tokens)


API_FIELDS: dict[str, ApiFields] = {
    "chat": ApiFields(
        max_tokens=("max_completion_tokens", COMMON_MAX_TOKENS),
        quoted_max_tokens=COMMON_MAX_TOKENS,
        own=frozenset({"messages", "tools", "tool_choice", "logprobs", "top_logprobs",
                       "prompt_logprobs", "add_generation_prompt", "continue_final_message",
                       "return_tokens_as_token_ids"})),
    "completion": ApiFields(
        max_tokens=(COMMON_MAX_TOKENS,),
        quoted_max_tokens=COMMON_MAX_TOKENS,
        own=frozenset({"prompt", "logprobs", "echo", "prompt_logprobs",
                       "return_tokens_as_token_ids"})),
    "llama": ApiFields(
        max_tokens=("n_predict", COMMON_MAX_TOKENS),
        quoted_max_tokens="n_predict",
        own=frozenset({"prompt", "return_tokens", "n_probs", "post_sampling_probs"})),
}
