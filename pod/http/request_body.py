"""Receiving a request's body: refused as soon as it passes --max-body-bytes, timed out when it
stalls for --timeout-body, cut off when the drain aborts what is left.

The body is read message by message rather than with Starlette's `request.body()`: the limit
holds while it comes in (not once it is buffered), and a stalled client or the drain ends the wait.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import Message

from ..requests.errors import ApiError
from ..requests.json_body import decode_body
from .lifecycle import SHUT_DOWN, Server


async def read_json(request: Request, server: Server) -> dict[str, Any]:
    """The body as a JSON object, decoded off the event loop (a large body takes a while)."""
    raw = await read_body(request, server)
    return await run_in_threadpool(decode_body, raw)


async def read_body(request: Request, server: Server) -> bytes:
    config = server.config
    return await read_limited(request, config.max_body_bytes, config.timeout_body,
                              server.aborted)


async def read_limited(request: Request, limit: int, timeout: float,
                       aborted: asyncio.Event) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` bytes (declared or sent), with
    408 when no part of it comes for `timeout` seconds, with 503 once `aborted` is set."""
    too_large = ApiError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)",
                         param="body")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size, more = [], 0, True
    while more:
        message = await next_message(request, timeout, aborted)
        if message["type"] == "http.disconnect":  # nobody reads the answer: no traceback
            raise ApiError(499, "the client went away while sending the body", param="body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def next_message(request: Request, timeout: float, aborted: asyncio.Event) -> Message:
    receive = asyncio.ensure_future(request.receive())
    abort = asyncio.ensure_future(aborted.wait())
    try:
        done, _ = await asyncio.wait({receive, abort}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        receive.cancel()
        abort.cancel()
    if receive in done:
        return receive.result()
    close = {"Connection": "close"}  # the rest of the body is not read
    if abort in done:
        raise ApiError(503, SHUT_DOWN, error_type="unavailable", headers=close)
    raise ApiError(408, f"no part of the request body came for {timeout:g} s (--timeout-body)",
                   param="body", error_type="timeout", headers=close)
