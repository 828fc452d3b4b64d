"""A streamed response as server-sent events: each of the engine's events for a request, shaped
by its API's wire format, as one `data:` line; queue and park notices as SSE comments.

The stream ends with the format's usage and `[DONE]` where its API sends them; a client that
goes away before every sequence finished has them cancelled, so their slots, pages and host RAM
are freed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ..core.engine import Engine
from ..core.messages import StreamEvent
from .formats.wire import WireFormat
from .stream import RequestStream

NOTICES = {StreamEvent.QUEUED: "queued", StreamEvent.PARKED: "preempted",
           StreamEvent.RESUMED: "resumed", StreamEvent.RECOMPUTED: "recomputed",
           StreamEvent.KEEPALIVE: "keepalive"}


def sse(payload: dict[str, Any] | str, named: bool = False) -> str:
    """A `data:` line; `named`: under `event: <the payload's type>` (Anthropic's and the
    Responses API's streams)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    if named and isinstance(payload, dict):
        return f"event: {payload['type']}\ndata: {data}\n\n"
    return f"data: {data}\n\n"


def from_lines(payloads: list[dict[str, Any]], named: bool = False) -> str:
    return "".join(sse(p, named) for p in payloads)


async def stream_events(stream: RequestStream, engine: Engine, fmt: WireFormat,
                        keepalive: float) -> AsyncIterator[str]:
    """`fmt`: the request's wire format (`formats.get_format`), which the caller may read once
    the stream ended; `keepalive`: --sse-keepalive."""
    named = fmt.named_events
    finished = 0
    opened = False
    try:
        async for event in stream.events(keepalive):
            fmt.observe(event)
            if event.kind in NOTICES:  # SSE comments: clients and proxies ignore them
                yield f": {NOTICES[event.kind]}\n\n"
                continue
            if not opened:  # a request parked before its first token opens with a notice
                opened = True
                yield from_lines(fmt.opening(), named)
            chunk = None
            if event.kind is StreamEvent.PROGRESS:
                chunk = fmt.progress(event.progress)
            elif event.kind is StreamEvent.TEXT:
                chunks = fmt.text_chunks(event.index, event.text, event.num_logprobs)
                if chunks:
                    yield from_lines(chunks, named)
            elif event.kind is StreamEvent.FINISHED:
                finished += 1
                if event.result.failed:
                    yield sse(fmt.failure_event(event.result), named)
                else:
                    yield from_lines(fmt.finish_chunks(event.result), named)
            if chunk is not None:  # a format may have nothing to say of an event
                yield sse(chunk, named)
        if fmt.include_usage:
            yield sse(fmt.usage())
        if fmt.ends_with_done:
            yield sse("[DONE]")
    finally:
        if finished < stream.num_seqs:  # the client went away: free slot, pages, host RAM
            engine.cancel(stream.seq_ids)
