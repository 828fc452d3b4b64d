"""Anthropic's Messages API shapes: the message (content blocks: text, then `tool_use`), and a
stream of named events (`message_start`, `content_block_start`, `content_block_delta`,
`content_block_stop`, `message_delta`, `message_stop`; `ping` where a tool call is still being
written; `error` for a failure), as the `anthropic` SDK reads them.

Tool calls come from the same generic JSON format as chat's (`requests/tools.py`), parsed once
the output is complete: a stream sends them, each as one `input_json_delta`, before its end.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from ...core.messages import FinishReason, SeqResult
from ...requests import partial_json
from ...requests.errors import ApiError
from .results import failure
from .wire import WireFormat


class AnthropicFormat(WireFormat):
    ends_with_done: ClassVar[bool] = False
    named_events: ClassVar[bool] = True  # each SSE data line under `event: <its type>`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: str | None = None  # a stream's block now open: its type
        self._index = -1  # and its index

    @property
    def message_id(self) -> str:
        return "msg_" + self.id_suffix

    # ---- the whole message -------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        seq = self.stream.result(0)
        return {**self.message([]), "content": self.blocks(seq),
                "stop_reason": self.stop_reason(seq), "stop_sequence": self.stop_sequence(seq),
                "usage": self.usage_of(seq)}

    def message(self, content: list[Any]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": None,
                "stop_sequence": None}

    def blocks(self, seq: SeqResult) -> list[dict[str, Any]]:
        parsed = self.parsed(seq)
        thinking = [thinking_block(parsed.reasoning)] if parsed.reasoning else []
        text = [{"type": "text", "text": parsed.content or ""}] \
            if parsed.content or not parsed.tool_calls else []
        return thinking + text + [tool_use(call) for call in parsed.tool_calls]

    def stop_reason(self, seq: SeqResult) -> str:
        if seq.finish_reason is FinishReason.LENGTH:
            return "max_tokens"
        if self.parsed(seq).tool_calls:
            return "tool_use"
        return "stop_sequence" if seq.stopped_by_word else "end_turn"

    def stop_sequence(self, seq: SeqResult) -> str | None:
        """Which stop string ended it: the one the full output continues with after the text."""
        if not seq.stopped_by_word:
            return None
        rest = self.stream.tokenizer.decode(list(seq.generated_ids))[len(seq.text):]
        return next((s for s in self.stream.request.params.stop if rest.startswith(s)), None)

    def usage_of(self, seq: SeqResult) -> dict[str, int]:
        return {"input_tokens": seq.num_prompt - seq.num_cached,
                "cache_read_input_tokens": seq.num_cached, "cache_creation_input_tokens": 0,
                "output_tokens": seq.num_generated}

    # ---- a stream ----------------------------------------------------------------------------
    # Without tools the blocks go out as the text comes: a thinking block while the model
    # reasons, then the text block. With tools they are known once the output is complete.
    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {
            **self.message([]), "usage": {"input_tokens": len(self.stream.prompts[0]),
                                          "output_tokens": 0}}}]

    def text_chunks(self, index: int, text: str, num_logprobs: int | None = None
                    ) -> list[dict[str, Any]]:
        if self.with_tools:
            return [{"type": "ping"}]
        events = self.deltas(*self.split(index, text))
        return events or [{"type": "ping"}]  # text held back: still alive

    def deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if reasoning:
            events += self.block("thinking")
            events.append(self.delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            events += self.block("text")
            events.append(self.delta({"type": "text_delta", "text": content}))
        return events

    def block(self, kind: str) -> list[dict[str, Any]]:
        """Events that make a `kind` block the open one (the one open before ends)."""
        if self._open == kind:
            return []
        events = self.close_block()
        self._open, self._index = kind, self._index + 1
        start = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        return [*events, {"type": "content_block_start", "index": self._index,
                          "content_block": start}]

    def close_block(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        # a thinking block closes with its signature (empty: nothing to verify here), as the
        # API sends one before every thinking block's stop
        signed = [self.delta({"type": "signature_delta", "signature": ""})] \
            if self._open == "thinking" else []
        self._open = None
        return [*signed, {"type": "content_block_stop", "index": self._index}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def progress(self, progress: Any) -> dict[str, Any]:
        return {"type": "ping"}

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        if self.with_tools:
            events = [event for i, block in enumerate(self.blocks(seq))
                      for event in streamed_block(i, block)]
        else:  # what a tag held back, and the text block the message always has
            events = [*self.deltas(*self.split(seq.index, None)), *self.block("text"),
                      *self.close_block()]
        return [*events,
                {"type": "message_delta", "delta": {"stop_reason": self.stop_reason(seq),
                                                    "stop_sequence": self.stop_sequence(seq)},
                 "usage": self.usage_of(seq)},
                {"type": "message_stop"}]

    def failure_event(self, seq: SeqResult) -> dict[str, Any]:
        return error_body(failure(seq))


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "tool_use", "id": call["id"], "name": function["name"],
            "input": input_of(function["arguments"])}


def input_of(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; cut short by max_tokens (the
    stop reason says so), the members written whole."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        node = partial_json.parse_prefix(arguments)
        members = node.members if node is not None and node.kind == "object" else {}
        return {key: member.value(arguments) for key, member in members.items()
                if member.complete}
    return value if isinstance(value, dict) else {}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def streamed_block(index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
    """A complete block as a stream sends it: start (empty), its deltas, stop."""
    if block["type"] == "text":
        start = {"type": "text", "text": ""}
        deltas = [{"type": "text_delta", "text": block["text"]}]
    elif block["type"] == "thinking":  # its (empty) signature before the stop, as the API's
        start = thinking_block("")
        deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                  {"type": "signature_delta", "signature": ""}]
    else:
        start = {**block, "input": {}}
        deltas = [{"type": "input_json_delta",
                   "partial_json": json.dumps(block["input"], ensure_ascii=False)}]
    return [{"type": "content_block_start", "index": index, "content_block": start},
            *({"type": "content_block_delta", "index": index, "delta": d} for d in deltas),
            {"type": "content_block_stop", "index": index}]


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else
                           "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
