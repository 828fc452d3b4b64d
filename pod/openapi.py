"""The server's OpenAPI 3.0 document, served at /openapi.json.

It describes what the parsers accept (`protocol.py`, with the field names of `api_fields.py` and
the bounds of `sampling_fields.py`) and what the routes answer, so a client generator or a fuzzer
(the tests run schemathesis against it) can hold the server to it.
"""

from __future__ import annotations

from typing import Any

from .api_fields import (
    API_FIELDS,
    MAX_BIAS,
    MAX_COMPLETION_LOGPROBS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    NO_LIMIT,
    RANGES,
    UNLIMITED_AT_NO_LIMIT,
)
from .chat_messages import CHAT_ROLES
from .input_limits import InputLimits
from .protocol import MAX_BATCH_PROMPTS

JSON = "application/json"
SSE = "text/event-stream"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _sampling(kind: str, max_context: int) -> dict[str, Any]:
    """The fields every generation route takes, and its own names for the output limit."""
    props: dict[str, Any] = {
        "model": {"type": "string"},
        **_ranges(max_context, "temperature", "top_p", "top_k", "min_p", "seed"),
        "stop": {"oneOf": [{"type": "string", "maxLength": MAX_STOP_CHARS},
                           {"type": "array", "maxItems": MAX_STOP_STRINGS,
                            "items": {"type": "string", "maxLength": MAX_STOP_CHARS}}]},
        "ignore_eos": {"type": "boolean"},
        "n": _range("n", max_context),
        "stream": {"type": "boolean"},
        "priority": _range("priority", max_context),
        "stream_options": {"type": "object",
                           "properties": {"include_usage": {"type": "boolean"}}},
        **_penalties(max_context),
    }
    return {**props, **_max_tokens(kind, max_context)}


def _max_tokens(kind: str, max_context: int) -> dict[str, Any]:
    """Each of the API's names for the output limit: 1..max_context, or null (not sent); -1
    (unlimited) too under llama.cpp's name, which is not nullable."""
    limited = {"type": "integer", "minimum": 1, "maximum": max_context, "nullable": True}
    unlimited = {"type": "integer", "oneOf": [{"enum": [NO_LIMIT]},
                                              {"minimum": 1, "maximum": max_context}]}
    return {name: unlimited if name in UNLIMITED_AT_NO_LIMIT else limited
            for name in API_FIELDS[kind].max_tokens}


def _range(name: str, max_context: int) -> dict[str, Any]:
    """A numeric field's schema: its row of `RANGES`."""
    lo, hi = RANGES[name].bounds(max_context)
    return {"type": RANGES[name].type, "minimum": lo, "maximum": hi}


def _ranges(max_context: int, *names: str) -> dict[str, Any]:
    return {name: _range(name, max_context) for name in names}


def _penalties(max_context: int) -> dict[str, Any]:
    bias = {"type": "number", "minimum": -MAX_BIAS, "maximum": MAX_BIAS}
    return {
        **_ranges(max_context, "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "repeat_penalty", "repeat_last_n", "min_tokens"),
        # OpenAI's {"token id": bias}, or llama.cpp's [[token id, bias or false], ...]
        "logit_bias": {"oneOf": [
            {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "additionalProperties": bias},
            {"type": "array", "maxItems": MAX_LOGIT_BIAS, "items": {
                "type": "array", "minItems": 2, "maxItems": 2}}]},
    }


def _structured() -> dict[str, Any]:
    """response_format, and llama.cpp's grammar and json_schema (accepted on every route)."""
    return {
        "response_format": {"oneOf": [
            {"type": "object", "required": ["type"], "properties": {
                "type": {"type": "string", "enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"type": "string", "enum": ["json_schema"]},
                "json_schema": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"}, "strict": {"type": "boolean"},
                    "schema": {"type": "object"}}}}}]},
        "grammar": {"type": "string", "description": "GBNF (llama.cpp)"},
        "json_schema": {"type": "object", "description": "a JSON schema (llama.cpp)"},
        "structured_outputs": {"type": "object", "description": "vLLM's: one of json, regex, "
                               "choice, grammar, json_object", "properties": {
                                   "json": {"type": "object"}, "regex": {"type": "string"},
                                   "choice": {"type": "array", "items": {"type": "string"}},
                                   "grammar": {"type": "string"},
                                   "json_object": {"type": "boolean"}}},
    }


def _prompt_logprobs(max_context: int) -> dict[str, Any]:
    return {"prompt_logprobs": {**_range("prompt_logprobs", max_context),
                                "nullable": True, "description": "vLLM's: each prompt "
                                "token's logprob and the k most likely"}}


def _tools() -> dict[str, Any]:
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": {"type": "array", "items": {"type": "object", "required": ["type", "function"],
                                             "properties": {
            "type": {"type": "string", "enum": ["function"]}, "function": function}}},
        "tool_choice": {"oneOf": [
            {"type": "string", "enum": ["auto", "required", "none"]}, named]},
        "parallel_tool_calls": {"type": "boolean"},
    }


def _error_responses(codes: tuple[int, ...]) -> dict[str, Any]:
    return {str(code): {"description": "an OpenAI-style error",
                        "content": {JSON: {"schema": _ref("Error")}}} for code in codes}


def _generation_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the completion, or an SSE stream when `stream` is true",
                    "content": {JSON: {"schema": _ref(response)}, SSE: {"schema": {
                        # each server-sent event: `data:` a JSON chunk, or [DONE]
                        "type": "object", "required": ["data"],
                        "properties": {"data": {"type": "string"},
                                       "event": {"type": "string"}}}}}},
            **_error_responses((400, 401, 408, 413, 500, 503)),
        },
    }}


def _json_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "ok", "content": {JSON: {"schema": _ref(response)}}},
                      **_error_responses((400, 401, 408, 413, 503))}}}


def get_openapi(limits: InputLimits) -> dict[str, Any]:
    max_context, max_chars = limits.max_context, limits.max_prompt_chars
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"type": "string", "enum": ["text"]},
                                "text": {"type": "string", "maxLength": max_chars}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": sorted(CHAT_ROLES)},
        "content": {"oneOf": [{"type": "string", "maxLength": max_chars},
                              {"type": "array", "items": text_part}]},
        "tool_calls": {"type": "array", "description": "assistant: the calls it made",
                       "items": {"type": "object"}},
        "tool_call_id": {"type": "string", "description": "tool: the call this answers"}}}
    prompt = {"oneOf": [{"type": "string", "minLength": 1, "maxLength": max_chars},
                        {"type": "array", "items": {"type": "string", "maxLength": max_chars},
                         "minItems": 1, "maxItems": 1},
                        {"type": "array", "items": {"type": "integer", "minimum": 0},
                         "minItems": 1}]}
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    # /v1/completions also takes a batch: a list of texts or of token-id lists
    batched_prompt = {"oneOf": [
        {"type": "string", "minLength": 1, "maxLength": max_chars},
        {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": max_chars},
         "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
        token_ids,
        {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS}]}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens",
                                            "total_tokens"],
             "properties": {**{k: {"type": "integer"} for k in
                               ("prompt_tokens", "completion_tokens", "total_tokens")},
                            "prompt_tokens_details": {"type": "object", "properties": {
                                "cached_tokens": {"type": "integer"}}}}}
    finish = {"type": "string", "enum": ["stop", "length", "tool_calls"], "nullable": True}
    schemas: dict[str, Any] = {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": "string", "nullable": True},
                           "code": {"type": "integer"}}}}},
        "ChatRequest": {"type": "object", "required": ["messages"], "properties": {
            "messages": {"type": "array", "items": message, "minItems": 1,
                         "maxItems": limits.max_messages},
            **_sampling("chat", max_context),
            **_structured(), **_tools(),
            "logprobs": {"type": "boolean"}, **_prompt_logprobs(max_context),
            "add_generation_prompt": {"type": "boolean"},
            "continue_final_message": {"type": "boolean"},
            "top_logprobs": _range("top_logprobs", max_context)}},
        "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
            "prompt": batched_prompt, **_sampling("completion", max_context),
            **_structured(), **_prompt_logprobs(max_context),
            "echo": {"type": "boolean", "description": "the prompt before the output; with "
                     "max_tokens 0 (allowed with echo only) it is scored, nothing generated"},
            "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS,
                         "nullable": True}}},
        "LlamaCompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
            "prompt": prompt, "return_tokens": {"type": "boolean"},
            **_sampling("llama", max_context), **_structured(),
            "n": {"type": "integer", "minimum": 1, "maximum": 1},
            "n_probs": _range("n_probs", max_context)}},
        "ChatResponse": {"type": "object", "required": ["id", "object", "choices", "usage"],
                         "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "finish_reason": finish,
                "message": {"type": "object", "properties": {
                    "role": {"type": "string"},
                    "content": {"type": "string", "nullable": True},  # null: tool calls
                    "tool_calls": {"type": "array", "items": {"type": "object"}}}}}}}}},
        "CompletionResponse": {"type": "object", "required": ["id", "object", "choices"],
                               "properties": {
            "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
            "choices": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer"}, "text": {"type": "string"},
                "finish_reason": finish}}}}},
        "TokenizeRequest": {"type": "object", "required": ["content"], "properties": {
            "content": {"type": "string", "maxLength": max_chars},
            "add_special": {"type": "boolean"}, "with_pieces": {"type": "boolean"}},
            "description": "llama.cpp's `content`; vLLM's `prompt` (with `add_special_tokens`) "
                           "or `messages` (with `add_generation_prompt`, "
                           "`continue_final_message`) are accepted in its place"},
        "TokenizeResponse": {"type": "object", "required": ["tokens"], "properties": {
            "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"oneOf": [
                {"type": "integer"},
                {"type": "object", "required": ["id", "piece"], "properties": {
                    "id": {"type": "integer"},
                    "piece": {"oneOf": [{"type": "string"},  # or its bytes: not whole UTF-8
                                        {"type": "array", "items": {"type": "integer"}}]}}}]}}}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "DetokenizeResponse": {"type": "object", "required": ["content"], "properties": {
            "content": {"type": "string"}, "prompt": {"type": "string"}}},
        "ApplyTemplateRequest": {"type": "object", "required": ["messages"], "properties": {
            "messages": {"type": "array", "items": {"type": "object"}, "minItems": 1},
            "add_generation_prompt": {"type": "boolean"},
            "continue_final_message": {"type": "boolean"}}},
        "ApplyTemplateResponse": {"type": "object", "required": ["prompt"], "properties": {
            "prompt": {"type": "string"}}},
        "LlamaCompletionResponse": {"type": "object", "required": ["content", "stop", "timings"],
                                    "properties": {
            "content": {"type": "string"}, "stop": {"type": "boolean"},
            "tokens_predicted": {"type": "integer"}, "tokens_evaluated": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "timings": {"type": "object"}}},
    }
    plain_get = {"get": {"responses": {"200": {"description": "ok"},
                                       **_error_responses((401, 503))}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvpark", "version": "0.1.0",
                 "description": "OpenAI-compatible LLM server that parks KV instead of failing"},
        "paths": {
            "/v1/chat/completions": _generation_op("chat", "ChatRequest", "ChatResponse"),
            "/v1/completions": _generation_op("completion", "CompletionRequest",
                                              "CompletionResponse"),
            "/completion": _generation_op("llama.cpp completion", "LlamaCompletionRequest",
                                          "LlamaCompletionResponse"),
            "/v1/models": plain_get,
            "/v1/models/{model_id}": {"get": {
                "parameters": [{"name": "model_id", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model card"},
                              **_error_responses((401, 404, 503))}}},
            "/tokenize": _json_op("text to token ids (llama.cpp)", "TokenizeRequest",
                                  "TokenizeResponse"),
            "/detokenize": _json_op("token ids to text (llama.cpp)", "DetokenizeRequest",
                                    "DetokenizeResponse"),
            "/apply-template": _json_op("the chat template applied (llama.cpp)",
                                        "ApplyTemplateRequest", "ApplyTemplateResponse"),
            "/version": plain_get,
            "/props": plain_get,
            "/health": {"get": {"responses": {
                "200": {"description": "ready"}, "503": {"description": "loading or draining"}}}},
            "/slots": plain_get,
            "/slots/{slot_id}": {"post": {
                "summary": "park or unpark a slot by hand; save, restore or erase its KV "
                           "(llama-server's slot files, with --slot-save-path)",
                "parameters": [
                    {"name": "slot_id", "in": "path", "required": True,
                     "schema": {"type": "integer", "minimum": 0}},
                    {"name": "action", "in": "query", "required": True,
                     "schema": {"type": "string",
                                "enum": ["park", "unpark", "save", "restore", "erase"]}}],
                "requestBody": {"required": False, "content": {JSON: {"schema": {
                    "type": "object", "properties": {"filename": {"type": "string"}}}}}},
                "responses": {"200": {"description": "the slot after the action; for save, "
                                      "restore and erase llama-server's answer"},
                              **_error_responses((400, 401, 403, 404, 409, 503))}}},
            "/metrics": {"get": {"responses": {
                "200": {"description": "Prometheus text", "content": {
                    "text/plain": {"schema": {"type": "string"}}}},
                "503": {"description": "loading"}}}},
        },
        "components": {"schemas": schemas},
    }
