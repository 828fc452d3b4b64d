"""Tool calling in llama.cpp's "generic" format, for chat templates that do not know tools:
the tools and the expected JSON are described in a system message, the output is constrained
to `{"tool_calls": [{"name": ..., "arguments": {...}}]}` (or, with tool_choice auto, to
`{"response": ...}` as well) and parsed back into OpenAI's `tool_calls`.

History in OpenAI's shape (assistant `tool_calls`, `tool` messages) is rewritten the same way
for such templates: a call as the JSON the model was asked to write, a tool's result as a user
message `{"tool_response": ...}` (what minja's polyfill does for llama.cpp).
"""

from __future__ import annotations

import json
import re
import reprlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..sampling.grammar import Grammar
from . import partial_json

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("auto", "required", "none")
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60
_REPR.fillvalue = "…"


def _shown(value: Any) -> str:
    """Client input quoted short: an error message never echoes all of it."""
    text = _REPR.repr(value)
    return text if len(text) <= 100 else text[:99] + "…"


class ToolError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}': {message}")
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    def call_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": self.name},
                                                 "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tools: which may be called, and must one be."""

    tools: tuple[Tool, ...]
    choice: str  # auto, required, none, or function (the one named)
    named: str | None = None
    parallel: bool = True
    response_schema: dict[str, Any] | None = None  # a plain answer's shape (response_format)

    @property
    def can_call(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def callable_tools(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.named in (None, t.name))

    def output_schema(self) -> dict[str, Any]:
        calls: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": {"anyOf": [t.call_schema()
                                                     for t in self.callable_tools()]}}
        if not self.parallel:
            calls["maxItems"] = 1
        call = {"type": "object", "properties": {"tool_calls": calls},
                "required": ["tool_calls"], "additionalProperties": False}
        if self.choice != "auto":
            return call
        answer = {"type": "object",
                  "properties": {"response": self.response_schema or {"type": "string"}},
                  "required": ["response"], "additionalProperties": False}
        return {"anyOf": [call, answer]}

    def grammar(self) -> Grammar:
        return Grammar.from_json_schema(self.output_schema())

    def instructions(self) -> str:
        tools = json.dumps([t.as_openai() for t in self.callable_tools()], indent=2,
                           ensure_ascii=False)
        example = json.dumps({"tool_calls": [{"name": "tool_name",
                                              "arguments": {"arg1": "some_value"}}]}, indent=2)
        how = ("Respond in JSON format, either with `tool_calls` (a request to call tools) or "
               "with `response` (your reply to the user's request)." if self.choice == "auto"
               else "Respond in JSON format with `tool_calls` (a request to call tools).")
        return (f"You can call any of the following tools to satisfy the user's requests: "
                f"{tools}\n\nExample tool call syntax:\n\n{example}\n\n{how}")


# ---- the request ----------------------------------------------------------------------------

def get_tool_plan(body: dict[str, Any]) -> ToolPlan | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None without tools."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "needs 'tools'")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolError("tools", f"expected a list of at most {MAX_TOOLS} tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolError("tools", "two tools have the same name")
    kind, named = _choice(choice, names)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", "expected true or false")
    return ToolPlan(tools, kind, named, parallel)


def _tool(raw: Any, index: int) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise ToolError(where, "expected {'type': 'function', 'function': {...}}, got "
                        f"{_shown(raw)}")
    function = raw.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function", "expected an object with 'name' (got "
                        f"{_shown(raw)})")
    name = function.get("name")
    # OpenAI's rule: a name is what fits in a call without escaping (and cannot smuggle a
    # special-token text such as <|im_end|> into the constrained output)
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name", "expected a name of 1 to 64 letters, digits, "
                        f"'_' or '-', got {_shown(name)}")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description", "expected a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters", "expected a JSON schema object")
    return Tool(name, description, parameters)


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolError("tool_choice", f"expected one of {', '.join(CHOICES)} or "
                            "{'type': 'function', 'function': {'name': ...}}")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", "expected {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise ToolError("tool_choice", f"names a function not in 'tools': {name[:64]!r}")
    return "function", name


# ---- the history ----------------------------------------------------------------------------

def polyfill_messages(messages: list[dict[str, Any]], plan: ToolPlan | None
                      ) -> list[dict[str, Any]]:
    """Messages for a template without tools: calls and results as text, and the tools'
    description in the system message when a call may be made."""
    names = {}  # tool_call_id -> the function's name, for the tool messages that answer it
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            names.update((c["id"], c["function"]["name"]) for c in calls)
            text = json.dumps({"tool_calls": [{
                "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"]),
                "id": c["id"]} for c in calls]}, ensure_ascii=False)
            content = message.get("content")
            out.append(_reasoning_kept(message, {
                "role": "assistant", "content": f"{content}\n{text}" if content else text}))
        elif message["role"] == "tool":
            response = {"tool": names.get(message["tool_call_id"], ""),
                        "tool_call_id": message["tool_call_id"], "content": message["content"]}
            out.append({"role": "user", "content": json.dumps({"tool_response": response},
                                                              ensure_ascii=False)})
        else:
            out.append(_reasoning_kept(message, {"role": message["role"],
                                                 "content": message["content"]}))
    if plan is not None and plan.can_call:
        out = with_system(out, plan.instructions())
    return out


def _reasoning_kept(message: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's reasoning stays beside its rewritten text: the template renders it."""
    if "reasoning_content" in message:
        out["reasoning_content"] = message["reasoning_content"]
    return out


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- the output -----------------------------------------------------------------------------

@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None  # a think block's text (`sampling/reasoning.py`)


def parse_output(text: str) -> ParsedOutput:
    """The model's generic-format JSON -> OpenAI's message parts; cut short by max_tokens, as
    far as it got (`parse_cut_short`). Output nested deeper than the decoders follow is
    returned as the text it is."""
    try:
        return _parse_output(text)
    except RecursionError:
        return ParsedOutput(text)


def _parse_output(text: str) -> ParsedOutput:
    try:
        value = json.loads(text)
    except ValueError:
        return parse_cut_short(text)
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        calls = [_openai_call(c) for c in value["tool_calls"] if isinstance(c, dict)]
        return ParsedOutput(None, [c for c in calls if c is not None])
    if isinstance(value, dict) and "response" in value:
        response = value["response"]
        return ParsedOutput(response if isinstance(response, str)
                            else json.dumps(response, ensure_ascii=False))
    return ParsedOutput(text)


def _openai_call(call: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(call.get("name"), str):
        return None
    return _call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_cut_short(text: str) -> ParsedOutput:
    """Output that ended before its JSON closed: the grammar kept it a prefix of the generic
    format, so it is read as far as it goes. The client gets what OpenAI gives for a call cut
    short — each call whose name is whole, its arguments as the text so far — or the answer's
    text so far; never kvpark's wire format itself."""
    try:
        root = partial_json.parse_prefix(text)
    except ValueError:  # not the generic format at all (no grammar held it): the model's text
        return ParsedOutput(text)
    if root is None or root.kind != "object":
        return ParsedOutput(text.strip() if root is None else text)
    calls, response = root.members.get("tool_calls"), root.members.get("response")
    if calls is not None and calls.kind == "array":
        whole_names = [call for node in calls.items if (call := _call_so_far(node, text))]
        return ParsedOutput(None, whole_names) if whole_names else ParsedOutput("")
    if response is not None:
        return ParsedOutput(response.text if response.kind == "string"
                            else text[response.start:response.end].strip())
    return ParsedOutput("")  # cut before the first key was whole: nothing said yet


def _call_so_far(node: partial_json.Node, text: str) -> dict[str, Any] | None:
    name = node.members.get("name")
    if node.kind != "object" or name is None or not name.complete or name.kind != "string":
        return None
    arguments = node.members.get("arguments")
    if arguments is None:
        return _call(name.text, "")
    if arguments.complete:
        return _call(name.text, json.dumps(arguments.value(text), ensure_ascii=False))
    return _call(name.text, text[arguments.start:arguments.end].rstrip())
