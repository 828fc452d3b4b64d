"""The server's OpenAPI 3.0 document, served at /openapi.json.

It describes what the parsers accept (the request bodies are built from the parsers' own field
table and bounds: `requests/field_schemas.py`) and what the routes answer, so a client generator
or a fuzzer (the tests run schemathesis against it) can hold the server to it.
"""

from __future__ import annotations

from typing import Any

from ..requests.field_schemas import request_schema
from ..requests.input_limits import InputLimits

JSON = "application/json"
SSE = "text/event-stream"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_responses(codes: tuple[int, ...]) -> dict[str, Any]:
    return {str(code): {"description": "an OpenAI-style error",
                        "content": {JSON: {"schema": _ref("Error")}}} for code in codes}


def _generation_op(summary: str, request: str, response: str,
                   errors: tuple[int, ...] = (400, 401, 408, 413, 500, 503)) -> dict[str, Any]:
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
            **_error_responses(errors),
        },
    }}


def _json_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "ok", "content": {JSON: {"schema": _ref(response)}}},
                      **_error_responses((400, 401, 408, 413, 503))}}}


def get_openapi(limits: InputLimits) -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvpark", "version": "0.1.0",
                 "description": "OpenAI-compatible LLM server that parks KV instead of failing"},
        "paths": _paths(),
        "components": {"schemas": _schemas(limits)},
    }


def _schemas(limits: InputLimits) -> dict[str, Any]:
    max_chars = limits.max_prompt_chars
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
        # the request bodies: every field the parsers read, from the same tables
        "ChatRequest": request_schema("chat", limits),
        "CompletionRequest": request_schema("completion", limits),
        "LlamaCompletionRequest": request_schema("llama", limits),
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
        **api_schemas(),
        "LlamaCompletionResponse": {"type": "object", "required": ["content", "stop", "timings"],
                                    "properties": {
            "content": {"type": "string"}, "stop": {"type": "boolean"},
            "tokens_predicted": {"type": "integer"}, "tokens_evaluated": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "timings": {"type": "object"}}},
    }
    return schemas


def api_schemas() -> dict[str, Any]:
    """Anthropic's Messages API and OpenAI's Responses API, their fields as
    `requests/anthropic.py` and `requests/responses_api.py` read them."""
    block = {"type": "object", "required": ["type"], "properties": {"type": {
        "type": "string", "enum": ["text", "tool_use", "tool_result", "thinking"]}}}
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": ["user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]}}}
    fields = {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": message, "minItems": 1},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]},
        "tools": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"},
            "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
            "name": {"type": "string"}}}}
    sampling = {
        "max_tokens": {"type": "integer", "minimum": 1},
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number"},
        "top_k": {"type": "integer"}, "stream": {"type": "boolean"}}
    return {
        "MessagesRequest": {"type": "object", "required": ["max_tokens", "messages"],
                            "properties": {**fields, **sampling}},
        "MessagesResponse": {"type": "object", "required": ["id", "type", "content", "usage"],
                             "properties": {"id": {"type": "string"},
                                            "type": {"type": "string", "enum": ["message"]},
                                            "content": {"type": "array", "items": block},
                                            "stop_reason": {"type": "string"},
                                            "usage": {"type": "object"}}},
        "ResponsesRequest": {"type": "object", "required": ["input"], "properties": {
            "model": {"type": "string"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                     "items": {"type": "object"}}]},
            "instructions": {"type": "string"}, "previous_response_id": {"type": "string"},
            "store": {"type": "boolean"}, "stream": {"type": "boolean"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number"},
            "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"],
                                                 "properties": {
                "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"},
                "parameters": {"type": "object"}}}},
            "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "required", "none"]},
                                      {"type": "object"}]},
            "text": {"type": "object"}}},
        "ResponsesResponse": {"type": "object", "required": ["id", "object", "output"],
                              "properties": {"id": {"type": "string"},
                                             "object": {"type": "string", "enum": ["response"]},
                                             "status": {"type": "string"},
                                             "output": {"type": "array",
                                                        "items": {"type": "object"}},
                                             "usage": {"type": "object"}}},
        "CountTokensRequest": {"type": "object", "required": ["messages"],
                               "properties": fields},
        "CountTokensResponse": {"type": "object", "required": ["input_tokens"],
                                "properties": {"input_tokens": {"type": "integer"}}},
    }


def _paths() -> dict[str, Any]:
    plain_get = {"get": {"responses": {"200": {"description": "ok"},
                                       **_error_responses((401, 503))}}}
    return {
        "/v1/chat/completions": _generation_op("chat", "ChatRequest", "ChatResponse"),
        "/v1/completions": _generation_op("completion", "CompletionRequest",
                                          "CompletionResponse"),
        "/completion": _generation_op("llama.cpp completion", "LlamaCompletionRequest",
                                      "LlamaCompletionResponse"),
        "/v1/messages": _generation_op("Anthropic's Messages API (SSE events when `stream`)",
                                       "MessagesRequest", "MessagesResponse"),
        "/v1/messages/count_tokens": _json_op("the prompt's tokens (Anthropic)",
                                              "CountTokensRequest", "CountTokensResponse"),
        "/v1/responses": _generation_op(  # 404: a previous_response_id not stored
            "OpenAI's Responses API (SSE events when `stream`)", "ResponsesRequest",
            "ResponsesResponse", (400, 401, 404, 408, 413, 500, 503)),
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
    }
