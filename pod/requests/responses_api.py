"""OpenAI's Responses API request (`POST /v1/responses`, what the current `openai` SDK and agent
frameworks call first) as the chat body the chat parser reads: `instructions` as the system
message, `input` (a string or items: messages, `function_call`, `function_call_output`) after
the conversation a `previous_response_id` names, `tools` as functions, `text.format` as
`response_format`, `max_output_tokens` as `max_tokens`. Errors name the Responses field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from . import fields
from .errors import ApiError, bad_field, shown

# `return_progress`: llama-server's prompt progress, as `response.in_progress` events
SAMPLING = ("temperature", "top_p", "stream", "model", "parallel_tool_calls", "return_progress")
# chat's own sampling fields a client may send beside (vLLM's extra sampling parameters)
EXTENSIONS = fields.SAMPLING - {"stop", "n", "stream_options", *SAMPLING}
# what the response object repeats of its request
ECHOED = ("instructions", "tools", "tool_choice", "metadata", "text", "max_output_tokens",
          "temperature", "top_p", "previous_response_id", "parallel_tool_calls", "store")
TEXT_PARTS = {"input_text", "output_text", "text"}

Lookup = Callable[[str], list[dict[str, Any]] | None]  # a stored conversation by response id


def to_chat_body(body: dict[str, Any], lookup: Lookup) -> tuple[dict[str, Any], list[dict]]:
    """The chat body, and the conversation it holds (what a later turn continues from)."""
    history = previous(body.get("previous_response_id"), lookup)
    conversation = [*history, *input_messages(body.get("input"))]
    system = instructions(body.get("instructions"))
    chat: dict[str, Any] = {"messages": [*system, *conversation]}
    for name in (*SAMPLING, *sorted(EXTENSIONS & body.keys())):
        if name in body:
            chat[name] = body[name]
    for name in sorted(fields.REASONING & body.keys()):  # chat's reasoning fields, as sent
        chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = functions(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    if body.get("reasoning") is not None:
        chat.update(reasoning(body["reasoning"]))
    response_format = text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, conversation


def previous(response_id: Any, lookup: Lookup) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    if not isinstance(response_id, str):
        raise bad_field("previous_response_id", "a string is required")
    found = lookup(response_id)
    if found is None:
        raise ApiError(404, f"'previous_response_id': no stored response {shown(response_id)} "
                       "(never stored, made with store: false, or dropped from memory)",
                       param="previous_response_id", error_type="invalid_request_error")
    return found


def instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise bad_field("instructions", "a string is required")
    return [{"role": "system", "content": value}]


def input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_field("input", "a string or a non-empty list of items is required")
    out: list[dict[str, Any]] = []
    thoughts: list[str] = []  # reasoning items: on the assistant turn that follows them
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(where, "an object is required")
        kind = item.get("type", "message")
        if kind == "reasoning":
            thoughts.append(reasoning_item(item, where))
            continue
        if kind == "message":
            out.append(message(item, where))
        elif kind == "function_call":
            out.append(function_call(item, where, out))
        elif kind == "function_call_output":
            out.append(function_output(item, where))
        else:
            raise bad_field(f"{where}.type", f"{shown(kind)} items are not supported here")
        turn = out[-1] or out[-2]  # a call joined to the message before it leaves {}
        if thoughts and turn.get("role") == "assistant":
            turn["reasoning_content"] = "\n".join(thoughts)
            thoughts.clear()
    return [m for m in out if m]


def reasoning_item(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `content` (reasoning_text parts), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad_field(f"{where}.content", "a list of reasoning_text parts is required")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise bad_field(f"{where}.content[{j}]", "a part with a text string is required")
        texts.append(part["text"])
    return "".join(texts)


def reasoning(value: Any) -> dict[str, Any]:
    """`reasoning.effort` as chat's `reasoning_effort` (none turns thinking off)."""
    if not isinstance(value, dict):
        raise bad_field("reasoning", "an object is required")
    effort = value.get("effort")
    if effort is None:
        return {}
    if not isinstance(effort, str):
        raise bad_field("reasoning.effort", "a string is required")
    return {"reasoning_effort": effort}


def message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_field(f"{where}.role", "user, assistant, system or developer")
    content = item.get("content")
    if isinstance(content, list):
        content = parts_text(content, f"{where}.content")
    elif not isinstance(content, str):
        raise bad_field(f"{where}.content", "a string or a list of text parts is required")
    return {"role": role, "content": content}


def parts_text(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_field(f"{where}[{j}]", f"{shown(kind)} parts are not supported here "
                            "(text only)")
        texts.append(part["text"])
    return "".join(texts)


def function_call(item: dict[str, Any], where: str, out: list[dict[str, Any]]
                  ) -> dict[str, Any]:
    """An earlier call: joined to the assistant message just before it, as chat keeps them."""
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise bad_field(f"{where}.{name}", "a string is required")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = out[-1] if out else None
    if last is not None and last.get("role") == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
        return {}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def function_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise bad_field(f"{where}.call_id", "a string is required")
    output = item.get("output")
    if isinstance(output, list):
        output = parts_text(output, f"{where}.output")
    elif not isinstance(output, str):
        output = json.dumps(output)
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_field("tools", "a list of tools is required")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad_field(f"tools[{i}].type", f"{shown(kind)}: only function tools run here")
        if not isinstance(tool.get("name"), str):
            raise bad_field(f"tools[{i}].name", "a string is required")
        function = {"name": tool["name"],
                    "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def tool_choice(choice: Any) -> Any:
    if choice in ("auto", "required", "none"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", "auto, required, none or {type: function, name}")


def text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        if "strict" in fmt:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise bad_field("text.format.type", "text, json_object or json_schema")


def echoed(body: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The request's fields a response repeats, as values."""
    return tuple((name, body[name]) for name in ECHOED if name in body)
