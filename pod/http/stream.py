"""A request's events on the event loop: its `RequestStream` keeps what the engine thread's
`Event` values said (`core/reporting.py` makes them) and never sees a sequence; `open_stream`
makes the stream and the `Submission`s whose sink feeds it. `SSEResponse` notices a client that
went away even while nothing is being sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..core.messages import Event, SeqResult, StreamEvent, Submission
from ..model.tokenizer import Tokenizer
from ..requests.parsers import GenerationRequest
from ..sampling.sampler import TokenLogprob

# after these a sequence sends nothing until it runs again; TEXT, RESUMED or its end says it does
QUIET = frozenset({StreamEvent.QUEUED, StreamEvent.PARKED})


class EventSink:
    """A request's channel from the engine thread: each event is handed to its stream by the
    event loop (the engine thread only schedules that)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, put: Callable[[Event], None]) -> None:
        self.loop, self.put = loop, put

    def __call__(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.put, event)


@dataclass
class ReaderWatch:
    """A stream whose client reads slower than its sequences generate: past `limit` unread
    events they are parked (`hold`), and once the client has read down to half of that they
    may run again (`let_go`). So a client's read speed reaches neither the engine, whose steps
    never wait on a socket anyway, nor anybody else's share of the steps."""

    limit: int  # --max-stream-backlog; 0: never
    hold: Callable[[], None]
    let_go: Callable[[], None]
    holding: bool = False

    def after_put(self, unread: int) -> None:
        if self.limit and not self.holding and unread > self.limit:
            self.holding = True
            self.hold()

    def after_take(self, unread: int) -> None:
        if self.holding and unread <= self.limit // 2:
            self.holding = False
            self.let_go()


@dataclass
class Choice:
    """What the event loop has been told of one sequence (from the events, never from it)."""

    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    slot_id: int | None = None
    result: SeqResult | None = None

    def record(self, event: Event) -> None:
        if event.kind is StreamEvent.TEXT:
            self.logprobs.extend(event.logprobs)
            self.token_ids.extend(event.token_ids)
            self.prompt_logprobs = self.prompt_logprobs or event.prompt_logprobs
            self.slot_id = event.slot_id
        elif event.kind is StreamEvent.FINISHED:
            self.result = event.result
            self.prompt_logprobs = event.result.prompt_logprobs
            self.logprobs = list(event.result.logprobs)
            self.slot_id = event.result.slot_id


@dataclass
class RequestStream:
    """One request's sequences, seen from asyncio: only what their events said."""

    tokenizer: Tokenizer
    request: GenerationRequest  # batched prompts share all but the prompt and the echo
    request_id: str
    prompts: list[tuple[int, ...]]  # prompt p's choices are p * n .. p * n + n - 1
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    echoes: dict[int, str] = field(default_factory=dict)  # choice -> its echoed prompt
    choices: list[Choice] = field(default_factory=list)
    reader: ReaderWatch | None = None  # a streamed response's: how far its client reads behind

    def __post_init__(self) -> None:
        self.choices = [Choice() for _ in range(self.num_seqs)]

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.request.params.n

    @property
    def seq_ids(self) -> list[str]:
        """Its sequences' request ids (what a cancel names)."""
        if self.num_seqs == 1:
            return [self.request_id]
        return [f"{self.request_id}/{index}" for index in range(self.num_seqs)]

    def prompt_ids(self, index: int) -> tuple[int, ...]:
        return self.prompts[index // self.request.params.n]

    # asyncio side
    def put(self, event: Event) -> None:
        self.queue.put_nowait(event)
        if self.reader is not None:
            self.reader.after_put(self.queue.qsize())

    async def events(self, keepalive: float | None = None) -> AsyncIterator[Event]:
        """The sequences' events until all finished; a KEEPALIVE every `keepalive` seconds of
        silence while one of them waits for a slot or is parked (known from the events
        themselves, not from the engine's live state)."""
        remaining = self.num_seqs
        quiet: set[int] = set()  # sequences queued or parked, by index
        while remaining:
            try:
                event = await asyncio.wait_for(self.queue.get(),
                                               keepalive if keepalive and quiet else None)
            except asyncio.TimeoutError:  # noqa: UP041 (a distinct class before Python 3.11)
                yield Event(StreamEvent.KEEPALIVE, -1)
                continue
            if self.reader is not None:
                self.reader.after_take(self.queue.qsize())
            if event.kind in QUIET:
                quiet.add(event.index)
            elif event.kind is not StreamEvent.RECOMPUTED:
                quiet.discard(event.index)
            if event.kind is StreamEvent.FINISHED:
                remaining -= 1
            self.choices[event.index].record(event)
            yield event

    async def wait_finished(self) -> None:
        async for _ in self.events():
            pass

    def result(self, index: int) -> SeqResult:
        result = self.choices[index].result
        assert result is not None, "read once the sequence's FINISHED event came"
        return result

    @property
    def results(self) -> list[SeqResult]:
        return [self.result(index) for index in range(self.num_seqs)]

    def preempt_summary(self) -> dict[str, int]:
        return {"parks": sum(r.n_preempt for r in self.results),
                "recomputes": sum(r.n_recompute for r in self.results)}


def open_stream(loop: asyncio.AbstractEventLoop, tokenizer: Tokenizer,
                requests: list[GenerationRequest], request_id: str
                ) -> tuple[RequestStream, list[Submission]]:
    """A request's stream (several prompts of a batched `prompt` share one: prompt p's j-th
    choice is choice p * n + j, OpenAI's order) and the submissions for the engine."""
    first = requests[0]
    stream = RequestStream(tokenizer, first, request_id,
                           [tuple(r.prompt_ids) for r in requests])
    sink = EventSink(loop, stream.put)
    params, n = first.params, first.params.n
    submissions = []
    for p, request in enumerate(requests):
        for j in range(n):
            index = p * n + j
            if request.echo is not None:
                stream.echoes[index] = request.echo
            submissions.append(Submission(
                stream.seq_ids[index], tuple(request.prompt_ids), params,
                None if params.seed is None else params.seed + j, sink, index,
                family_size=n, priority=request.priority, grammar=request.grammar,
                return_progress=request.return_progress, thinking=request.thinking_gate))
    return stream, submissions


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
