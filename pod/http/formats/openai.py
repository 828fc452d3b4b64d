"""OpenAI's chat and completions shapes (and chat whose output may be tool calls)."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from ...core.messages import FinishReason, PromptProgress, SeqResult
from .logprobs import chat_logprobs, completion_logprobs, echoed_logprobs, joined_logprobs
from .results import finish_reason, timings, usage
from .wire import WireFormat


class OpenAIFormat(WireFormat):
    object_name: ClassVar[str]
    chunk_object_name: ClassVar[str]

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.stream.request_id, "object": self.chunk_object_name,
                 "created": int(time.time()), "model": self.model,
                 "system_fingerprint": self.fingerprint, "choices": choices}
        if self.include_usage:
            chunk["usage"] = self.usage_so_far() if self.stream.request.continuous_usage else None
        return chunk

    def usage_so_far(self) -> dict[str, int]:
        """vLLM's continuous usage stats: the prompt, and the tokens the events reported."""
        prompt = sum(len(p) for p in self.stream.prompts)
        completion = sum(self._generated.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def progress(self, progress: PromptProgress) -> dict[str, Any]:
        return {**self._chunk([]), "prompt_progress": progress.as_json()}

    def body(self) -> dict[str, Any]:
        seqs = self.stream.results
        return {"id": self.stream.request_id, "object": self.object_name,
                "created": int(time.time()), "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [self.choice(s) for s in seqs], "usage": usage(seqs),
                "timings": timings(seqs[0]), "preempt": self.stream.preempt_summary()}

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        raise NotImplementedError

    def usage(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(self.stream.results)
        return chunk


class ChatFormat(OpenAIFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, index: int, upto: int | None) -> dict[str, Any] | None:
        entries = self.take_logprobs(index, upto) if self.wants_logprobs else []
        return chat_logprobs(self.names, entries) if entries else None

    def body(self) -> dict[str, Any]:
        body = super().body()
        if self.stream.request.show_prompt_logprobs:  # vLLM: one list, beside the choices
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body

    def with_prompt_logprobs(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        if self.first_chunk_of(index) and index == 0 and self.stream.request.show_prompt_logprobs:
            chunk["prompt_logprobs"] = self.prompt_logprobs(0)
        return chunk

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        logprobs = (chat_logprobs(self.names, seq.logprobs) if self.wants_logprobs else None)
        parsed = self.parsed(seq)
        content = self.stream.echoes.get(seq.index, "") + (parsed.content or "")
        return {"index": seq.index, "message": {"role": "assistant", "content": content,
                                                **reasoning_fields(parsed.reasoning)},
                "logprobs": logprobs, "finish_reason": finish_reason(seq)}

    def opening(self) -> list[dict[str, Any]]:
        # content null, as llama-server and vLLM open: no delta's content is ever ""; an
        # echoed last assistant message opens the content
        return [self._chunk([{"index": i, "delta": {"role": "assistant",
                                                    "content": self.stream.echoes.get(i) or None},
                              "logprobs": None, "finish_reason": None}
                             for i in range(self.stream.num_seqs)])]

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        # text held back (a stop string may be starting, or a think tag) sends its logprobs
        # without content
        return self.with_prompt_logprobs(self._chunk([
            {"index": index, "delta": self.delta(*self.split(index, text)),
             "logprobs": self.logprobs(index, num_logprobs), "finish_reason": None}]), index)

    def delta(self, reasoning: str, content: str) -> dict[str, Any]:
        return {**reasoning_fields(reasoning or None), **({"content": content} if content else {})}

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        return self.with_prompt_logprobs(self._chunk([
            {"index": seq.index, "delta": {}, "logprobs": self.logprobs(seq.index, None),
             "finish_reason": finish_reason(seq)}]), seq.index)

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        rest = self.delta(*self.split(seq.index, None))  # text a think tag held back
        held = [self._chunk([{"index": seq.index, "delta": rest, "logprobs": None,
                              "finish_reason": None}])] if rest else []
        return [*held, self.finish(seq)]


class ToolChatFormat(ChatFormat):
    """A chat whose output may be tool calls: JSON in the generic format, parsed once complete
    into OpenAI's `tool_calls`; a stream sends the calls (or the answer) with its last chunk
    (deltas before it are empty, so a client sees progress)."""

    def finish_reason(self, seq: SeqResult) -> str:
        if seq.finish_reason is FinishReason.STOP and self.parsed(seq).tool_calls:
            return "tool_calls"
        return finish_reason(seq)

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        parsed = self.parsed(seq)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content,
                                   **reasoning_fields(parsed.reasoning)}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        return {"index": seq.index, "message": message, "logprobs": None,
                "finish_reason": self.finish_reason(seq)}

    def opening(self) -> list[dict[str, Any]]:
        # content null, not "": a call has no content (clients keep the first value they see)
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": None},
                              "logprobs": None, "finish_reason": None}
                             for i in range(self.stream.num_seqs)])]

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        reasoning, _ = self.split(index, text)  # the reasoning goes out as it comes
        return self._chunk([{"index": index, "delta": reasoning_fields(reasoning or None),
                             "logprobs": None, "finish_reason": None}])

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        return self._chunk([{"index": seq.index, "delta": {}, "logprobs": None,
                             "finish_reason": self.finish_reason(seq)}])

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        # the calls before the finish reason, as OpenAI sends them: clients close a call's
        # arguments when the next call or the finish reason comes
        parsed = self.parsed(seq)
        delta: dict[str, Any] = reasoning_fields(self.split(seq.index, None)[0] or None)
        if parsed.tool_calls:
            delta["tool_calls"] = [{"index": i, **call}
                                   for i, call in enumerate(parsed.tool_calls)]
        elif parsed.content:
            delta["content"] = parsed.content
        last = [self._chunk([{"index": seq.index, "delta": delta, "logprobs": None,
                              "finish_reason": None}])] if delta else []
        return [*last, self.finish(seq)]


def reasoning_fields(reasoning: str | None) -> dict[str, str]:
    """A think block's text under both names clients read: llama-server's and DeepSeek's
    `reasoning_content`, and vLLM's (and OpenRouter's) newer `reasoning`."""
    return {} if reasoning is None else {"reasoning_content": reasoning, "reasoning": reasoning}


class CompletionFormat(OpenAIFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def logprobs(self, index: int, upto: int | None) -> dict[str, Any] | None:
        entries = self.take_logprobs(index, upto) if self.wants_logprobs else []
        if not entries:
            return None
        shaped = completion_logprobs(self.names, entries, self._offset.get(index, 0))
        last = entries[-1]
        self._offset[index] = shaped["text_offset"][-1] + len(self.names.get(last.token)[0])
        return shaped

    def echoed(self, index: int) -> dict[str, Any] | None:
        """The echoed prompt's part of `logprobs` (None: no echo, or no logprobs asked)."""
        if index not in self.stream.echoes or not self.wants_logprobs:
            return None
        k = self.stream.request.params.logprobs or 0
        return echoed_logprobs(self.names, self.stream.prompt_ids(index),
                               self.stream.choices[index].prompt_logprobs, k)

    def choice(self, seq: SeqResult) -> dict[str, Any]:
        echo, echoed = self.stream.echoes.get(seq.index, ""), self.echoed(seq.index)
        offset = len("".join(echoed["tokens"])) if echoed else 0
        logprobs = (completion_logprobs(self.names, seq.logprobs, offset) if self.wants_logprobs
                    else None)
        if echoed:
            logprobs = joined_logprobs(echoed, logprobs)
        choice = {"index": seq.index, "text": echo + seq.text,
                  "logprobs": logprobs, "finish_reason": finish_reason(seq)}
        if self.stream.request.show_prompt_logprobs:
            choice["prompt_logprobs"] = self.prompt_logprobs(seq.index)
        return choice

    def shaped(self, index: int, text: str, upto: int | None, reason: str | None
               ) -> dict[str, Any]:
        """A stream's chunk; a choice's first one opens with its echo and prompt logprobs."""
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                  "finish_reason": reason}
        if self.first_chunk_of(index):
            echoed = self.echoed(index)
            choice["text"] = self.stream.echoes.get(index, "") + text
            if echoed:
                self._offset[index] = len("".join(echoed["tokens"]))
            if self.stream.request.show_prompt_logprobs:
                choice["prompt_logprobs"] = self.prompt_logprobs(index)
            choice["logprobs"] = (joined_logprobs(echoed, self.logprobs(index, upto))
                                  if echoed else self.logprobs(index, upto))
        else:
            choice["logprobs"] = self.logprobs(index, upto)
        return self._chunk([choice])

    def text(self, index: int, text: str, num_logprobs: int | None = None) -> dict[str, Any]:
        return self.shaped(index, text, num_logprobs, None)

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        return self.shaped(seq.index, "", None, finish_reason(seq))
