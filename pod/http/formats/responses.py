"""OpenAI's Responses API shapes: the response object (output items: a `message` with its
`output_text`, then `function_call`s), and a stream of named, numbered events
(`response.created`, `response.output_text.delta`, ..., `response.completed`), as the `openai`
SDK's `responses.create` and `responses.stream` read them. Tool calls come from the generic JSON
format (`requests/tools.py`), parsed once the output is complete, so a stream with tools sends
its items at the end.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from ...core.messages import FinishReason, PromptProgress, SeqResult
from .results import failure, timings
from .wire import WireFormat


class ResponsesFormat(WireFormat):
    ends_with_done: ClassVar[bool] = False
    named_events: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sequence = 0
        self._created = int(time.time())
        self._opened: list[str] = []  # the types of the items a stream opened (the last open)

    @property
    def response_id(self) -> str:
        return "resp_" + self.id_suffix

    @property
    def message_id(self) -> str:
        return "msg_" + self.id_suffix

    @property
    def reasoning_id(self) -> str:
        return "rs_" + self.id_suffix

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    # ---- the response ------------------------------------------------------------------------
    def response(self, seq: SeqResult | None) -> dict[str, Any]:
        echoed = dict(self.stream.request.echoed)
        incomplete = seq is not None and seq.finish_reason is FinishReason.LENGTH
        return {
            "id": self.response_id, "object": "response", "created_at": self._created,
            "status": "in_progress" if seq is None else
            "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "model": self.model,
            "output": [] if seq is None else self.output(seq),
            "instructions": echoed.get("instructions"),
            "tools": echoed.get("tools", []), "tool_choice": echoed.get("tool_choice", "auto"),
            "parallel_tool_calls": echoed.get("parallel_tool_calls", True),
            "temperature": echoed.get("temperature"), "top_p": echoed.get("top_p"),
            "max_output_tokens": echoed.get("max_output_tokens"),
            "previous_response_id": echoed.get("previous_response_id"),
            "text": echoed.get("text", {"format": {"type": "text"}}),
            "metadata": echoed.get("metadata", {}), "store": echoed.get("store", True),
            "truncation": "disabled",
            "usage": None if seq is None else self.usage_of(seq)}

    def body(self) -> dict[str, Any]:
        return self.response(self.stream.result(0))

    def output(self, seq: SeqResult) -> list[dict[str, Any]]:
        parsed = self.parsed(seq)
        thinking = [self.reasoning(parsed.reasoning)] if parsed.reasoning else []
        items = [self.message(parsed.content or "", seq)] \
            if parsed.content or not parsed.tool_calls else []
        return thinking + items + [function_call(call) for call in parsed.tool_calls]

    def reasoning(self, text: str | None) -> dict[str, Any]:
        """A reasoning item (None: as it opens, nothing written yet)."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": content, "status": "in_progress" if text is None else "completed"}

    def message(self, text: str, seq: SeqResult | None) -> dict[str, Any]:
        status = "in_progress" if seq is None else (
            "incomplete" if seq.finish_reason is FinishReason.LENGTH else "completed")
        content = [] if seq is None else [output_text(text)]
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}

    def turn(self, seq: SeqResult) -> dict[str, Any]:
        """The assistant's turn as a stored conversation keeps it: text, or the calls (with
        the ids this response gave them)."""
        parsed = self.parsed(seq)
        turn: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:  # the template renders it where it wants it
            turn["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            turn["tool_calls"] = parsed.tool_calls
        return turn

    def usage_of(self, seq: SeqResult) -> dict[str, Any]:
        return {"input_tokens": seq.num_prompt,
                "input_tokens_details": {"cached_tokens": seq.num_cached},
                "output_tokens": seq.num_generated,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(seq)},
                "total_tokens": seq.num_prompt + seq.num_generated}

    def reasoning_tokens(self, seq: SeqResult) -> int:
        """The think block's tokens: its text tokenised again (the tags not counted)."""
        reasoning = self.parsed(seq).reasoning
        return len(self.stream.tokenizer.encode(reasoning, add_bos=False)) if reasoning else 0

    # ---- a stream ----------------------------------------------------------------------------
    # Without tools the items go out as the text comes: a reasoning item while the model
    # reasons, then the message. With tools they are known once the output is complete.
    def opening(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response(None)),
                self.event("response.in_progress", response=self.response(None))]

    def text_chunks(self, index: int, text: str, num_logprobs: int | None = None
                    ) -> list[dict[str, Any]]:
        if self.with_tools:
            return []
        return self.deltas(*self.split(index, text))

    def deltas(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if reasoning:
            events += self.open_item("reasoning")
            events.append(self.event("response.reasoning_text.delta",
                                     item_id=self.reasoning_id, output_index=self.item_index,
                                     content_index=0, delta=reasoning))
        if content:
            events += self.open_item("message")
            events.append(self.event("response.output_text.delta", item_id=self.message_id,
                                     output_index=self.item_index, content_index=0,
                                     delta=content, logprobs=[]))
        return events

    @property
    def item_index(self) -> int:
        return len(self._opened) - 1

    def open_item(self, kind: str) -> list[dict[str, Any]]:
        """Events that open a `kind` item (a reasoning item stays open until the message)."""
        if self._opened[-1:] == [kind]:
            return []
        self._opened.append(kind)
        if kind == "reasoning":
            return [self.event("response.output_item.added", output_index=self.item_index,
                               item=self.reasoning(None))]
        return [self.event("response.output_item.added", output_index=self.item_index,
                           item=self.message("", None)),
                self.event("response.content_part.added", item_id=self.message_id,
                           output_index=self.item_index, content_index=0,
                           part=output_text(""))]

    def progress(self, progress: PromptProgress) -> dict[str, Any] | None:
        """llama-server's `return_progress`: the prompt's progress on an in-progress event."""
        return self.event("response.in_progress", response=self.response(None),
                          prompt_progress=progress.as_json())

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.with_tools:  # what a tag held back; the message every answer has
            events += [*self.deltas(*self.split(seq.index, None)), *self.open_item("message")]
        for i, item in enumerate(self.output(seq)):
            events += self.streamed_item(i, item, opened=i < len(self._opened))
        # `response.completed` however it ended (its status says incomplete where it is): the
        # SDK's stream helper finds its final response only there
        # llama-server adds its timings beside the response
        return [*events, self.event("response.completed", response=self.response(seq),
                                    timings=timings(seq))]

    def streamed_item(self, index: int, item: dict[str, Any], opened: bool
                      ) -> list[dict[str, Any]]:
        """The rest of an item's events (`opened`: its start went out with the opening)."""
        events = [] if opened else [self.event("response.output_item.added",
                                               output_index=index, item=started(item))]
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if not opened:
                events.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                         output_index=index, content_index=0, delta=text))
            events.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                     output_index=index, content_index=0, text=text))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            if not opened:
                events += [self.event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0,
                                      part=output_text("")),
                           self.event("response.output_text.delta", item_id=item["id"],
                                      output_index=index, content_index=0, delta=text,
                                      logprobs=[])]
            events += [self.event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=text, logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0,
                                  part=output_text(text))]
        else:
            events += [self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=index, delta=item["arguments"]),
                       self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"])]
        return [*events, self.event("response.output_item.done", output_index=index,
                                    item=item)]

    def failure_event(self, seq: SeqResult) -> dict[str, Any]:
        error = failure(seq)
        return self.event("error", code=error.error_type, message=error.message, param=None)


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def started(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `output_item.added` shows it: in progress, nothing written yet."""
    if item["type"] in ("message", "reasoning"):
        return {**item, "status": "in_progress", "content": []}
    return {**item, "status": "in_progress", "arguments": ""}
