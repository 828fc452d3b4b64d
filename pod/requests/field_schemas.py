"""Each request field's JSON schema, by the names the parsers read (`fields.API_FIELDS`): the
OpenAPI document builds every request body from this table and that one, so a field the parsers
take is a field the document states, with the bounds the parsers hold it to (`fields.RANGES`,
`MAX_*`). `request_schema(kind, limits)` is one API's body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .chat_messages import CHAT_ROLES
from .fields import (
    API_FIELDS,
    HARMLESS,
    MAX_BIAS,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    NO_LIMIT,
    RANGES,
    UNLIMITED_AT_NO_LIMIT,
)
from .input_limits import InputLimits
from .parsers import MAX_BATCH_PROMPTS
from .reasoning_fields import FORMATS, MAX_BUDGET, MAX_BUDGET_MESSAGE, MAX_KWARGS, RESERVED_KWARGS

BOOLEAN = {"type": "boolean"}
STRING = {"type": "string"}
OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Where:
    """What a field's schema depends on: the API (its `kind`) and the server's input limits."""

    kind: str
    limits: InputLimits

    @property
    def max_context(self) -> int:
        return self.limits.max_context

    @property
    def max_chars(self) -> int:
        return self.limits.max_prompt_chars


def ranged(name: str) -> Callable[[Where], dict[str, Any]]:
    """A numeric field's schema: its row of `RANGES`."""
    def schema(where: Where) -> dict[str, Any]:
        lo, hi = RANGES[name].bounds(where.max_context)
        return {"type": RANGES[name].type, "minimum": lo, "maximum": hi}
    return schema


def fixed(schema: dict[str, Any]) -> Callable[[Where], dict[str, Any]]:
    return lambda where: schema


def _max_tokens(name: str) -> Callable[[Where], dict[str, Any]]:
    """An output limit: 1..max_context, or null (not sent); -1 (unlimited) too under llama.cpp's
    name, which is not nullable."""
    def schema(where: Where) -> dict[str, Any]:
        limit = {"minimum": 1, "maximum": where.max_context}
        if name in UNLIMITED_AT_NO_LIMIT:
            return {"type": "integer", "oneOf": [{"enum": [NO_LIMIT]}, limit]}
        return {"type": "integer", **limit, "nullable": True}
    return schema


def _stop(where: Where) -> dict[str, Any]:
    return {"oneOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                      {"type": "array", "maxItems": MAX_STOP_STRINGS,
                       "items": {"type": "string", "maxLength": MAX_STOP_CHARS}}]}


def _logit_bias(where: Where) -> dict[str, Any]:
    """OpenAI's {"token id": bias}, or llama.cpp's [[token id, bias or false], ...]."""
    bias = {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}
    return {"oneOf": [
        {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "additionalProperties": bias},
        {"type": "array", "maxItems": MAX_LOGIT_BIAS, "items": {
            "type": "array", "minItems": 2, "maxItems": 2}}]}


def _n(where: Where) -> dict[str, Any]:
    if where.kind == "llama":  # /completion generates one sequence
        return {"type": "integer", "minimum": 1, "maximum": 1}
    return ranged("n")(where)


def _messages(where: Where) -> dict[str, Any]:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]},
                                "text": {"type": "string", "maxLength": where.max_chars}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": sorted(CHAT_ROLES)},
        "content": {"oneOf": [{"type": "string", "maxLength": where.max_chars},
                              {"type": "array", "items": text_part}]},
        "tool_calls": {"type": "array", "description": "assistant: the calls it made",
                       "items": OBJECT},
        "tool_call_id": {"type": "string", "description": "tool: the call this answers"}}}
    return {"type": "array", "items": message, "minItems": 1,
            "maxItems": where.limits.max_messages}


def _prompt(where: Where) -> dict[str, Any]:
    """A text or token ids; /v1/completions also takes a batch of either."""
    text = {"type": "string", "minLength": 1, "maxLength": where.max_chars}
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    if where.kind == "llama":
        return {"oneOf": [text, {"type": "array", "items": {
            "type": "string", "maxLength": where.max_chars}, "minItems": 1, "maxItems": 1},
            token_ids]}
    return {"oneOf": [text, {"type": "array", "items": text, "minItems": 1,
                             "maxItems": MAX_BATCH_PROMPTS},
                      token_ids, {"type": "array", "items": token_ids, "minItems": 1,
                                  "maxItems": MAX_BATCH_PROMPTS}]}


def _logprobs(where: Where) -> dict[str, Any]:
    """Chat: true or false (with `top_logprobs`); completions: how many alternatives."""
    if where.kind == "chat":
        return BOOLEAN
    return {"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS,
            "nullable": True}


def _response_format(where: Where) -> dict[str, Any]:
    return {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"type": "string", "enum": ["json_schema"]},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": STRING, "strict": BOOLEAN, "schema": OBJECT}}}}]}


def _tools(where: Where) -> dict[str, Any]:
    function = {"type": "object", "required": ["name"], "properties": {
        "name": STRING, "description": STRING, "parameters": OBJECT, "strict": BOOLEAN}}
    return {"type": "array", "items": {"type": "object", "required": ["type", "function"],
                                       "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": function}}}


def _tool_choice(where: Where) -> dict[str, Any]:
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {"name": STRING}}}}
    return {"oneOf": [{"type": "string", "enum": ["auto", "required", "none"]}, named]}


HARMLESS_SCHEMAS = {
    "string": STRING, "boolean": BOOLEAN, "object": OBJECT,
    "metadata": {"type": "object", "maxProperties": MAX_METADATA_PAIRS,
                 "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE},
                 "description": f"keys of at most {MAX_METADATA_KEY} characters"},
}
FIELD_SCHEMAS: dict[str, Callable[[Where], dict[str, Any]]] = {
    "model": fixed(STRING),
    **{name: ranged(name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "priority", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "repeat_penalty", "repeat_last_n",
        "min_tokens", "top_logprobs", "n_probs")},
    "prompt_logprobs": lambda where: {
        **ranged("prompt_logprobs")(where), "nullable": True,
        "description": "vLLM's: each prompt token's logprob and the k most likely"},
    "n": _n,
    "stop": _stop,
    "logit_bias": _logit_bias,
    "ignore_eos": fixed(BOOLEAN),
    "stream": fixed(BOOLEAN),
    "stream_options": fixed({"type": "object", "properties": {
        "include_usage": BOOLEAN, "continuous_usage_stats": BOOLEAN}}),
    "return_progress": fixed(BOOLEAN),
    **{name: fixed(HARMLESS_SCHEMAS[kind]) for name, kind in HARMLESS.items()},
    "response_format": _response_format,
    "grammar": fixed({"type": "string", "description": "GBNF (llama.cpp) or Lark"}),
    "json_schema": fixed({"type": "object", "description": "a JSON schema (llama.cpp)"}),
    "structured_outputs": fixed({"type": "object", "description": "vLLM's: one of json, "
                                 "regex, choice, grammar, json_object", "properties": {
                                     "json": OBJECT, "regex": STRING,
                                     "choice": {"type": "array", "items": STRING},
                                     "grammar": STRING, "json_object": BOOLEAN}}),
    "guided_json": fixed({"description": "vLLM's older structured_outputs.json",
                          "oneOf": [OBJECT, STRING]}),
    "guided_regex": fixed(STRING),
    "guided_choice": fixed({"type": "array", "items": STRING}),
    "guided_grammar": fixed(STRING),
    "messages": _messages,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "logprobs": _logprobs,
    "add_generation_prompt": fixed(BOOLEAN),
    "continue_final_message": fixed(BOOLEAN),
    "return_tokens_as_token_ids": fixed(BOOLEAN),
    "prompt": _prompt,
    "echo": lambda where: {"type": "boolean", "description": (
        "vLLM's: a last assistant message's content before the reply's"
        if where.kind == "chat" else "the prompt before the output; with max_tokens 0 "
        "(allowed with echo only) it is scored, nothing generated")},
    "return_tokens": fixed(BOOLEAN),
    "post_sampling_probs": fixed(BOOLEAN),
    "chat_template_kwargs": fixed({
        "type": "object", "maxProperties": MAX_KWARGS,
        "properties": {"enable_thinking": BOOLEAN},
        "description": "variables handed to the chat template (e.g. enable_thinking); "
        f"not {', '.join(sorted(RESERVED_KWARGS))}"}),
    "reasoning_effort": fixed({"type": "string", "description": "given to the template as "
                               "reasoning_effort; none turns thinking off"}),
    "reasoning_format": fixed({"type": "string", "enum": list(FORMATS), "description":
                               "llama-server's: how a think block is returned (deepseek: in "
                               "reasoning_content; none: in the content as written)"}),
    **{name: fixed({"type": "integer", "minimum": -1, "maximum": MAX_BUDGET,
                    "description": "tokens the think block may take (-1: unlimited)"})
       for name in ("reasoning_budget_tokens", "thinking_budget_tokens")},
    "reasoning_budget_message": fixed({
        "type": "string", "maxLength": MAX_BUDGET_MESSAGE,
        "description": "written before the forced end of a think block past its budget"}),
}
REQUIRED = {"chat": ["messages"], "completion": ["prompt"], "llama": ["prompt"]}


def field_schema(name: str, where: Where) -> dict[str, Any]:
    if name in API_FIELDS[where.kind].limit_names:
        return _max_tokens(name)(where)
    return FIELD_SCHEMAS[name](where)


def request_schema(kind: str, limits: InputLimits) -> dict[str, Any]:
    """One API's request body: every field its parser reads, nothing else stated."""
    where = Where(kind, limits)
    return {"type": "object", "required": REQUIRED[kind],
            "properties": {name: field_schema(name, where)
                           for name in sorted(API_FIELDS[kind].known)}}
