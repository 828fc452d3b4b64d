"""The Anthropic Messages API's request (`POST /v1/messages`, what the `anthropic` SDK and
Claude Code send) as the chat body the chat parser reads: `system` first, content blocks as
messages (`tool_use` as an assistant's tool calls, `tool_result` as tool messages), `tools` as
functions, `stop_sequences` as `stop`. Checked here with Anthropic's names, so an error names
the field the client sent.
"""

from __future__ import annotations

import json
from typing import Any

from . import fields
from .errors import ApiError, bad_field, shown

# what a model without images or a reasoning parser cannot use: said, not silently dropped
UNSUPPORTED_BLOCKS = {"image", "document", "search_result", "server_tool_use",
                      "web_search_tool_result", "container_upload"}
SKIPPED_BLOCKS = {"redacted_thinking"}  # encrypted reasoning: nothing a template could show
SAMPLING = ("temperature", "top_p", "top_k", "stream")
# chat's own sampling fields a client may send beside (vLLM's extra sampling parameters):
# `ignore_eos`, `seed`, `min_p`, penalties ... (not those this API names otherwise, nor `n`)
EXTENSIONS = fields.SAMPLING - {"model", "stop", "n", "stream_options", *SAMPLING}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat_body(body: dict[str, Any], needs_max_tokens: bool = True) -> dict[str, Any]:
    """`needs_max_tokens`: the Messages API requires it; /v1/messages/count_tokens does not."""
    if needs_max_tokens and "max_tokens" not in body:
        raise bad_field("max_tokens", "required")
    chat: dict[str, Any] = {"messages": [*system_messages(body.get("system")),
                                         *chat_messages(body.get("messages"))]}
    for name in (*SAMPLING, *sorted(EXTENSIONS & body.keys())):
        if name in body:
            chat[name] = body[name]
    for name in sorted(fields.REASONING & body.keys()):  # chat's reasoning fields, as sent
        chat[name] = body[name]
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    if "model" in body:
        chat["model"] = body["model"]
    if body.get("thinking") is not None:
        chat.update(thinking(body["thinking"], chat.get("chat_template_kwargs")))
    if body.get("stop_sequences") is not None:
        chat["stop"] = string_list(body["stop_sequences"], "stop_sequences")
    if body.get("tools"):
        chat["tools"] = functions(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    return chat


def thinking(value: Any, kwargs: Any) -> dict[str, Any]:
    """`thinking`: enabled (with its `budget_tokens`), adaptive or disabled, as the template's
    enable_thinking and the think block's budget."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_field("thinking.type", "one of enabled, adaptive, disabled")
    merged = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": kind != "disabled"}
    fields_: dict[str, Any] = {"chat_template_kwargs": merged}
    budget = value.get("budget_tokens")
    if kind == "enabled" and budget is not None:
        if type(budget) is not int or budget < 0:
            raise bad_field("thinking.budget_tokens", "a non-negative integer is required")
        fields_["thinking_budget_tokens"] = budget
    return fields_


def system_messages(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    return [{"role": "system", "content": block_text(system, "system")}]


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "a non-empty list of {role, content} is required")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_field(f"{where}.role", "must be 'user' or 'assistant'")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            out.extend(from_blocks(message["role"], content, where))
        else:
            raise bad_field(f"{where}.content", "a string or a list of content blocks")
    return out


def from_blocks(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One turn's blocks: its text (and an assistant's tool calls) as one message; each
    `tool_result` as a tool message before it, as OpenAI-style templates want them."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(text_of(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(tool_result(block, at))
        elif kind == "thinking" and role == "assistant":  # the template renders it (or not)
            thoughts.append(thinking_text(block, at))
        elif kind in SKIPPED_BLOCKS:
            continue
        elif kind in UNSUPPORTED_BLOCKS:
            raise bad_field(f"{at}.type", f"{kind} blocks are not supported by this server")
        else:
            raise bad_field(f"{at}.type", f"{shown(kind)} is not a content block for the "
                            f"{role} role here")
    # content may be left out only beside tool calls (OpenAI's rule, which the chat parser keeps)
    message: dict[str, Any] = {"role": role,
                               "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    keep = texts or calls or not results
    return [*results, *([message] if keep else [])]


def text_of(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_field(f"{at}.text", "a string is required")
    return block["text"]


def thinking_text(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("thinking"), str):
        raise bad_field(f"{at}.thinking", "a string is required")
    return block["thinking"]


def block_text(value: Any, name: str) -> str:
    """A string, or a list of text blocks (system prompts and tool results may be either)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(name, "a string or a list of text blocks")
    parts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad_field(f"{name}[{j}].type", "only text blocks are supported here")
        parts.append(text_of(block, f"{name}[{j}]"))
    return "".join(parts)


def tool_call(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise bad_field(at, "a tool_use block needs a string id and name")
    if not isinstance(block.get("input", {}), dict):
        raise bad_field(f"{at}.input", "an object is required")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"],
                         "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}}


def tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_field(f"{at}.tool_use_id", "a string is required")
    content = block_text(block.get("content", ""), f"{at}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def string_list(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_field(name, "a list of strings is required")
    return value


def functions(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_field("tools", "a list of tools is required")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_field(f"tools[{i}].name", "a string is required")
        if "type" in tool and tool["type"] not in ("custom", None):
            raise ApiError(400, f"'tools[{i}].type': {shown(tool['type'])} is a tool this "
                           "server does not run (only client tools with an input_schema)",
                           param=f"tools[{i}].type")
        function = {"name": tool["name"],
                    "parameters": tool.get("input_schema", {"type": "object"})}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field("tool_choice", "{type: auto | any | none} or {type: tool, name}")
