"""The generation routes (chat, completions, llama.cpp's /completion): admit, read the body into
requests, submit them to the engine, and answer as one JSON body or as a stream.

A request counts as open from its admission until its response ended, so the drain waits for
it; `admission.py` decides whether it gets in, `sse.py` shapes a stream, `formats/` a body.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...core.engine import Engine, EngineClosed
from ...requests import parsers as protocol
from ...requests.errors import ApiError
from ...serving.stack import ServingStack
from ..admission import check_admission, check_fits
from ..auth import check_auth
from ..build_info import fingerprint
from ..error_handlers import error_response
from ..formats import get_format
from ..formats.responses import ResponsesFormat
from ..formats.results import failure
from ..formats.wire import WireFormat
from ..lifecycle import SHUT_DOWN, Server
from ..request_body import read_body
from ..sse import stream_events
from ..stream import ReaderWatch, RequestStream, SSEResponse, open_stream, wait_disconnect

ID_PREFIXES = {"chat": "chatcmpl", "messages": "msg", "responses": "resp"}


class GenerationRoutes:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def generate(self, request: Request) -> Response:
        server = self.server
        kind = request.scope["route_kind"]
        check_auth(request, server.config.api_key)
        stack = server.ready_stack()
        check_admission(stack, server.draining, server.num_receiving,
                        server.config.max_queue)
        server.num_open += 1  # admitted: from here the drain waits for this response to end
        streaming = False
        try:
            stream = await self.read_request(request, stack, kind)
            if stream.request.stream:
                response = SSEResponse(self.sse_events(stack, stream),
                                       media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache"})
                response.on_close, streaming = server.end_request, True
                return response
            return await self.complete(request, stack, stream)
        finally:
            if not streaming:
                server.end_request()

    async def read_request(self, request: Request, stack: ServingStack,
                           kind: str) -> RequestStream:
        """Body -> request -> engine. It counts against --max-queue while its body comes in
        and is parsed (the engine's queue counts it after)."""
        server = self.server
        server.num_receiving += 1
        try:
            raw = await read_body(request, server)
            with stack.metrics.preparing.track_inprogress():  # templating, tokenising: off loop
                gens = await run_in_threadpool(protocol.parse_requests, kind, raw,
                                               stack.tokenizer, server.limits(stack),
                                               stack.defaults, server.responses.get)
            for i, gen in enumerate(gens):
                check_fits(stack, gen, f"[{i}]" if len(gens) > 1 else "")
            shut_down = ApiError(503, SHUT_DOWN, error_type="unavailable",
                                 headers={"Connection": "close"})
            if server.aborting:
                raise shut_down
            request_id = f"{ID_PREFIXES.get(kind, 'cmpl')}-{uuid.uuid4().hex}"
            stream, submissions = open_stream(asyncio.get_running_loop(), stack.tokenizer, gens,
                                              request_id)
            if stream.request.stream:
                stream.reader = watch_reader(stack.engine, stream.seq_ids,
                                             server.config.max_stream_backlog)
            try:
                stack.engine.submit(submissions)
            except EngineClosed:
                raise shut_down from None
            return stream
        finally:
            server.num_receiving -= 1

    async def complete(self, request: Request, stack: ServingStack,
                       stream: RequestStream) -> Response:
        done = asyncio.ensure_future(stream.wait_finished())
        gone = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            stack.engine.cancel(stream.seq_ids)
            return Response(status_code=499)
        gone.cancel()
        failed = [result for result in stream.results if result.failed]
        if failed:
            return error_response(failure(failed[0]), request.url.path)
        answer = get_format(self.server.model_name(stack), stream, fingerprint(stack.numerics))
        self.keep_response(stream, answer)
        # encoded off the event loop: logprobs of a long output make a large body
        return await run_in_threadpool(lambda: JSONResponse(answer.body()))

    def keep_response(self, stream: RequestStream, answer: WireFormat) -> None:
        """A Responses API answer with `store`: its conversation, for previous_response_id
        (the tool calls with the ids the client was sent)."""
        request = stream.request
        if not isinstance(answer, ResponsesFormat) or not request.store:
            return
        result = stream.result(0)
        if not result.failed:
            self.server.responses.put(answer.response_id,
                                      [*request.conversation, answer.turn(result)])

    async def sse_events(self, stack: ServingStack, stream: RequestStream
                         ) -> AsyncIterator[str]:
        answer = get_format(self.server.model_name(stack), stream, fingerprint(stack.numerics))
        async for chunk in stream_events(stream, stack.engine, answer,
                                         self.server.config.sse_keepalive):
            yield chunk
        self.keep_response(stream, answer)  # every sequence finished: the stream ran to its end


def watch_reader(engine: Engine, seq_ids: list[str], limit: int) -> ReaderWatch:
    """`limit` unread events a sequence: `n` choices and batched prompts each send theirs."""
    ids = tuple(seq_ids)
    return ReaderWatch(limit * len(ids), lambda: engine.hold_for_reader(ids),
                       lambda: engine.let_go_for_reader(ids))
