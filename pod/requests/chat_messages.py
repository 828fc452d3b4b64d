"""A chat request's `messages`, checked and cleaned for the template: known roles (`developer`
read as `system`), text content (a string or text parts), an assistant's `tool_calls` with JSON
object arguments, a tool result's `tool_call_id`; --max-messages and the prompt-text limit."""

from __future__ import annotations

import json
from typing import Any

from .errors import ApiError, shown
from .errors import bad_field as _bad
from .input_limits import InputLimits, check_chars
from .json_body import decode_field_text

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _message_text(message: dict, index: int, role: str) -> str | None:
    if message.get("function_call"):  # the legacy form of tool_calls
        raise ApiError(400, f"'messages[{index}].function_call' is not supported by this "
                       "server; send tool_calls", param=f"messages[{index}].function_call")
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        return None  # OpenAI: only an assistant message with tool calls may omit it
    if content is None:
        raise _bad(f"messages[{index}].content",
                   f"required for a {role} message (a string or a list of text parts)")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise _bad(f"messages[{index}].content",
                           "only text parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{index}].content", "expected a string or a list of text parts")


def _tool_calls(message: dict, index: int, role: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: arguments must be a JSON object's text."""
    calls = message.get("tool_calls")
    if not calls:
        return []
    where = f"messages[{index}].tool_calls"
    if role != "assistant" or not isinstance(calls, list):
        raise _bad(where, "only an assistant message has tool_calls (a list)")
    cleaned = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}[{i}]", "expected {'id', 'type': 'function', 'function': "
                       "{'name', 'arguments'}}")
        arguments = function.get("arguments", "{}")
        field = f"{where}[{i}].function.arguments"
        # some clients send the object itself
        parsed = decode_field_text(arguments, field) if isinstance(arguments, str) else arguments
        if not isinstance(parsed, dict):
            raise _bad(field, "expected a JSON object's text")
        call_id = call.get("id")
        cleaned.append({"id": call_id if isinstance(call_id, str) else f"call_{index}_{i}",
                        "type": "function", "function": {"name": function["name"],
                                                         "arguments": json.dumps(parsed)}})
    return cleaned


def _reasoning(message: dict, index: int, role: str) -> str | None:
    """An earlier assistant turn's reasoning (llama-server's and DeepSeek's `reasoning_content`,
    vLLM's `reasoning`): handed to the template, which renders it as it wants (Qwen's render
    it in the turns after the last user message)."""
    for name in ("reasoning_content", "reasoning"):
        value = message.get(name)
        if value is None:
            continue
        if role != "assistant" or not isinstance(value, str):
            raise _bad(f"messages[{index}].{name}", "a string, on an assistant message only")
        return value
    return None


def chat_messages(body: dict, limits: InputLimits) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    if len(messages) > limits.max_messages:
        raise _bad("messages", f"{len(messages)} messages; at most {limits.max_messages} are "
                   "accepted (--max-messages)")
    cleaned, num_chars = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"unknown role {shown(role)}")
        text = _message_text(message, i, role)
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": text}
        calls = _tool_calls(message, i, role)
        if calls:
            entry["tool_calls"] = calls
        reasoning = _reasoning(message, i, role)
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
            num_chars += len(reasoning)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"messages[{i}].tool_call_id", "required for a tool message")
            entry["tool_call_id"] = call_id
        num_chars += len(text or "") + sum(len(c["function"]["arguments"]) for c in calls)
        check_chars("messages", num_chars, limits)
        cleaned.append(entry)
    return cleaned
