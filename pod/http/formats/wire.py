"""`WireFormat`: one API's shapes for a request, the whole response or the chunks of a stream;
the base the OpenAI and llama.cpp formats share (logprobs sent once each, usage counted from the
events)."""

from __future__ import annotations

from typing import Any, ClassVar

from ...core.messages import Event, PromptProgress, SeqResult, StreamEvent
from ...requests.tools import ParsedOutput, parse_output
from ...sampling.reasoning import ReasoningSplitter, ThinkingRule, split_reasoning
from ...sampling.sampler import TokenLogprob
from ..stream import RequestStream
from .logprobs import TokenIdNames, TokenNames, vllm_prompt_logprobs
from .results import failure


class WireFormat:
    """One API's shapes for a request: the whole response, or the chunks of a stream."""

    ends_with_done: ClassVar[bool] = True  # `data: [DONE]` closes the stream
    named_events: ClassVar[bool] = False  # each data line under `event: <its type>`

    def __init__(self, model: str, stream: RequestStream, fingerprint: str = "") -> None:
        self.model = model
        self.stream = stream
        self.fingerprint = fingerprint  # OpenAI's system_fingerprint
        self.names = (TokenIdNames if stream.request.tokens_as_ids else TokenNames)(
            stream.tokenizer)
        self._num_sent: dict[int, int] = {}  # per choice: logprobs already in a chunk
        self._offset: dict[int, int] = {}  # per choice: text length those tokens cover
        self._opened: set[int] = set()  # choices whose first text chunk went out
        self._generated: dict[int, int] = {}  # per choice: tokens generated, as events said
        self._parsed: dict[int, ParsedOutput] = {}  # per choice: its output, parsed once
        self._splitters: dict[int, ReasoningSplitter] = {}  # per choice: a stream's think block

    @property
    def with_tools(self) -> bool:
        """The output may be tool calls (the generic JSON format, parsed once complete)."""
        return self.stream.request.tools is not None

    @property
    def id_suffix(self) -> str:
        """The request id's random part, for APIs that name their objects by their own prefix."""
        return self.stream.request_id.rpartition("-")[2]

    @property
    def thinking(self) -> ThinkingRule | None:
        """How the output's think block is returned (None: all of the text is content)."""
        return self.stream.request.thinking

    def parsed(self, seq: SeqResult) -> ParsedOutput:
        """A choice's output as reasoning, content and tool calls: parsed once, so every shape
        of it (body, stream, a stored turn) names its calls by the same ids."""
        if seq.index not in self._parsed:
            split = split_reasoning(seq.text, self.thinking)
            parsed = (parse_output(split.content) if self.with_tools
                      else ParsedOutput(split.content))
            parsed.reasoning = split.reasoning
            self._parsed[seq.index] = parsed
        return self._parsed[seq.index]

    def split(self, index: int, text: str | None) -> tuple[str, str]:
        """A stream's text as (reasoning, content) deltas by the same rules as `parsed`;
        `text` None: what was held back, once the choice finished."""
        rule = self.thinking
        if rule is None:
            return "", text or ""
        splitter = self._splitters.setdefault(index, ReasoningSplitter(rule))
        reasoning, content = splitter.push(text) if text is not None else splitter.finish()
        return reasoning, (text or "") if rule.keep_tags else content

    def observe(self, event: Event) -> None:
        """Counts from the events (values taken on the engine thread), for usage in chunks."""
        if event.kind is StreamEvent.TEXT:
            self._generated[event.index] = event.num_generated
        elif event.kind is StreamEvent.FINISHED:
            self._generated[event.index] = event.result.num_generated

    def progress(self, progress: PromptProgress) -> dict[str, Any] | None:
        """llama.cpp's prompt progress chunk (return_progress)."""
        raise NotImplementedError

    def first_chunk_of(self, index: int) -> bool:
        """True once per choice: the chunk that carries its echo and prompt logprobs."""
        first = index not in self._opened
        self._opened.add(index)
        return first

    def prompt_logprobs(self, index: int) -> list[dict[str, Any] | None] | None:
        if not self.stream.request.show_prompt_logprobs:
            return None
        return vllm_prompt_logprobs(self.names, self.stream.choices[index].prompt_logprobs)

    @property
    def wants_logprobs(self) -> bool:
        return self.stream.request.params.logprobs is not None

    def take_logprobs(self, index: int, upto: int | None = None) -> list[TokenLogprob]:
        """The choice's logprobs not sent yet, up to `upto` (a TEXT event's count; None: all,
        for a finished sequence). A chunk carries those of the tokens sampled since the
        previous one: its text's tokens, or a stop string's, or text still held back."""
        received = self.stream.choices[index].logprobs
        start = self._num_sent.get(index, 0)
        end = len(received) if upto is None else upto
        self._num_sent[index] = max(start, end)
        return received[start:end]

    @property
    def include_usage(self) -> bool:
        return self.stream.request.include_usage

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        """Chunks sent before the first text (or notice)."""
        return []

    def text(self, index: int, text: str, num_logprobs: int | None = None
             ) -> dict[str, Any] | None:
        """A TEXT event's chunk (None: nothing to send for it)."""
        raise NotImplementedError

    def text_chunks(self, index: int, text: str, num_logprobs: int | None = None
                    ) -> list[dict[str, Any]]:
        """A TEXT event's chunks: one, or none, or (blocks opening and closing) several."""
        chunk = self.text(index, text, num_logprobs)
        return [] if chunk is None else [chunk]

    def finish(self, seq: SeqResult) -> dict[str, Any]:
        raise NotImplementedError

    def finish_chunks(self, seq: SeqResult) -> list[dict[str, Any]]:
        """What a stream sends when `seq` ended: its last delta and finish reason."""
        return [self.finish(seq)]

    def usage(self) -> dict[str, Any]:
        raise NotImplementedError

    def failure_event(self, seq: SeqResult) -> dict[str, Any]:
        """What a stream sends for a sequence that failed."""
        return failure(seq).body()
