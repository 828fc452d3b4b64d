"""From the engine thread into asyncio: one `RequestStream` per request carries its sequences'
events, and `SSEResponse` notices a client that went away even while nothing is being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .grammar import get_grammars
from .model.tokenizer import Tokenizer
from .protocol import GenerationRequest
from .sampling import make_generator
from .slot import SeqEvent, Sequence
from .text_output import TextOutput


class StreamEvent(str, enum.Enum):
    TEXT = "text"  # visible text of one sequence
    QUEUED = "queued"  # waiting for a slot
    PARKED = "parked"
    RESUMED = "resumed"
    RECOMPUTED = "recomputed"
    FINISHED = "finished"
    KEEPALIVE = "keepalive"  # nothing happened for a while and a sequence queues or is parked


# after these a sequence sends nothing until it runs again; TEXT, RESUMED or its end says it does
QUIET = frozenset({StreamEvent.QUEUED, StreamEvent.PARKED})


@dataclass
class Event:
    kind: StreamEvent
    index: int  # the sequence (choice) it is about; -1 for KEEPALIVE
    text: str = ""
    num_logprobs: int = 0  # TEXT: the sequence's logprobs it covers, len(seq.logprobs) then


@dataclass
class RequestStream:
    """One request's sequences, seen from asyncio."""

    loop: asyncio.AbstractEventLoop
    tokenizer: Tokenizer
    request: GenerationRequest
    request_id: str
    seqs: list[Sequence] = field(default_factory=list)
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    echoes: dict[int, str] = field(default_factory=dict)  # choice -> its echoed prompt

    def __post_init__(self) -> None:
        params = self.request.params
        grammar = self.request.grammar
        if self.request.echo is not None:
            self.echoes = {index: self.request.echo for index in range(params.n)}
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            self.seqs.append(Sequence(
                request_id=self.request_id if params.n == 1 else f"{self.request_id}/{index}",
                prompt_ids=list(self.request.prompt_ids),
                params=params,
                generator=make_generator(seed),
                on_event=self.on_event,
                index=index,
                family_size=params.n,
                priority=self.request.priority,
                output=TextOutput(self.tokenizer, params.stop),
                # each sequence its own place in the grammar (compiled when it was parsed)
                constraint=None if grammar is None else get_grammars(
                    self.tokenizer).constraint(grammar),
            ))

    # engine thread
    def on_event(self, seq: Sequence, event: SeqEvent, text: str) -> None:
        if event is SeqEvent.FINISHED and not seq.failed:
            text = seq.output.finish()  # what was held back as a possible stop string
        if text:
            self._put(Event(StreamEvent.TEXT, seq.index, text, len(seq.logprobs)))
        if event is not SeqEvent.TOKEN:
            self._put(Event(StreamEvent(event.value), seq.index))

    def _put(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    # asyncio side
    async def events(self, keepalive: float | None = None) -> AsyncIterator[Event]:
        """The sequences' events until all finished; a KEEPALIVE every `keepalive` seconds of
        silence while one of them waits for a slot or is parked (known from the events
        themselves, not from the engine's live state)."""
        remaining = len(self.seqs)
        quiet: set[int] = set()  # sequences queued or parked, by index
        while remaining:
            try:
                event = await asyncio.wait_for(self.queue.get(),
                                               keepalive if keepalive and quiet else None)
            except asyncio.TimeoutError:  # noqa: UP041 (a distinct class before Python 3.11)
                yield Event(StreamEvent.KEEPALIVE, -1)
                continue
            if event.kind in QUIET:
                quiet.add(event.index)
            elif event.kind is not StreamEvent.RECOMPUTED:
                quiet.discard(event.index)
            if event.kind is StreamEvent.FINISHED:
                remaining -= 1
            yield event

    async def wait_finished(self) -> None:
        async for _ in self.events():
            pass

    def preempt_summary(self) -> dict[str, int]:
        return {"parks": sum(s.parking.n_preempt for s in self.seqs),
                "recomputes": sum(s.parking.n_recompute for s in self.seqs)}

    def text(self, index: int) -> str:
        return self.seqs[index].output.text


class SSEResponse(StreamingResponse):
    """Always listens for the client going away, even while nothing is being sent (a parked
    stream sends nothing for a while, and a disconnect must still free its slot). `on_close`
    runs when the response has ended, however it ended."""

    on_close: Callable[[], None] = staticmethod(lambda: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            try:
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await stream
                    await watcher
            finally:
                self.on_close()


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
