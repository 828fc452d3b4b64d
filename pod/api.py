"""Starlette routes: OpenAI chat/completions, llama.cpp /completion, /health, /slots, /metrics.

The engine runs on its own thread; each request gets a `RequestStream` that carries its
sequences' events from that thread into asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from . import protocol
from .args import ServerArgs
from .model.tokenizer import Tokenizer
from .openapi import get_openapi
from .protocol import ApiError, GenerationRequest, InputLimits
from .sampling import make_generator
from .scheduler import CONTEXT_EXCEEDED
from .server import ServingStack, build_stack
from .slot import Sequence
from .text_output import TextOutput

log = logging.getLogger("kvpark.api")

OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}
DRAIN_GRACE_SECONDS = 5.0  # after the shutdown timeout: for the final error events to go out
SHUT_DOWN = "the server shut down before this request finished"
NOTICES = {"parked": "preempted", "resumed": "resumed", "recomputed": "recomputed",
           "keepalive": "keepalive"}


@dataclass
class Event:
    kind: str  # "text", "parked", "resumed", "finished"
    index: int
    text: str = ""


@dataclass
class RequestStream:
    """One request's sequences, seen from asyncio."""

    loop: asyncio.AbstractEventLoop
    tokenizer: Tokenizer
    request: GenerationRequest
    request_id: str
    seqs: list[Sequence] = field(default_factory=list)
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    outputs: list[TextOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        params = self.request.params
        self.outputs = [TextOutput(self.tokenizer, params.stop) for _ in range(params.n)]
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
            ))

    # engine thread
    def on_event(self, seq: Sequence, kind: str, token: int | None) -> bool | None:
        output = self.outputs[seq.index]
        if kind == "token":
            assert token is not None
            self._put(Event("text", seq.index, output.push(token)))
            return output.stopped
        if kind == "finished" and seq.error is None:
            self._put(Event("text", seq.index, output.finish()))
        self._put(Event(kind, seq.index))
        return None

    def _put(self, event: Event) -> None:
        if event.kind != "text" or event.text:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    # asyncio side
    async def events(self, keepalive: float | None = None) -> AsyncIterator[Event]:
        """The sequences' events until all finished; a "keepalive" event every `keepalive`
        seconds of silence while one of them is parked."""
        remaining = len(self.seqs)
        while remaining:
            parked = keepalive and any(s.is_parked for s in self.seqs)
            try:
                event = await asyncio.wait_for(self.queue.get(), keepalive if parked else None)
            except asyncio.TimeoutError:  # noqa: UP041 (a distinct class before Python 3.11)
                yield Event("keepalive", -1)
                continue
            if event.kind == "finished":
                remaining -= 1
            yield event

    def preempt_summary(self) -> dict[str, int]:
        return {"parks": sum(s.parking.n_preempt for s in self.seqs),
                "recomputes": sum(s.parking.n_recompute for s in self.seqs)}

    def text(self, index: int) -> str:
        return self.outputs[index].text


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


def has_key(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    return hmac.compare_digest(given.encode(), key.encode())  # constant time


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(seqs: list[Sequence]) -> dict[str, Any]:
    completion = sum(s.num_generated for s in seqs)
    prompt = seqs[0].num_prompt
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": seqs[0].num_cached}}


def timings(seq: Sequence) -> dict[str, float]:
    """llama.cpp's timings: the prompt as sent (recompute replays are not in here); cache_n of
    its tokens came from the prefix cache (prompt_n still counts them, unlike llama.cpp)."""
    prompt_ms = seq.prompt_seconds * 1e3
    end = seq.finished_at or time.monotonic()
    predicted_ms = (end - seq.first_token_at) * 1e3 if seq.first_token_at else 0.0
    n = seq.num_generated
    return {
        "cache_n": seq.num_cached,
        "prompt_n": seq.num_prompt,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(1, seq.num_prompt),
        "prompt_per_second": seq.num_prompt / (prompt_ms / 1e3) if prompt_ms else 0.0,
        "predicted_n": n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / max(1, n),
        "predicted_per_second": n / (predicted_ms / 1e3) if predicted_ms else 0.0,
    }


def seq_error(seq: Sequence) -> ApiError:
    kind = "invalid_request_error" if seq.error_status < 500 else "server_error"
    return ApiError(seq.error_status, seq.error or "unknown error", error_type=kind)


class Server:
    def __init__(self, args: ServerArgs, stack: ServingStack | None = None) -> None:
        self.args = args
        self.stack = stack
        self.loading_error: str | None = None
        self.created = int(time.time())
        self.on_load_failed = lambda: None  # __main__ makes uvicorn exit
        self.draining = False
        # admitted requests: from their headers (before the body) until their response ended;
        # those still being received count against --max-queue, all of them hold the drain
        self.num_receiving = 0
        self.num_open = 0
        self.aborting = False  # the drain timed out: what is left ends with an explicit error
        self.aborted = asyncio.Event()  # `aborting`, for body reads to wake on
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.stack is None:
            try:
                self.stack = await asyncio.to_thread(build_stack, self.args)
            except Exception as exc:
                self.loading_error = f"{type(exc).__name__}: {exc}"
                log.exception("loading the model failed")
                self.on_load_failed()
                return
        self.stack.engine.start()
        log.info("serving %s on http://%s:%d", self.stack.model_name, self.args.host,
                 self.args.port)

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.engine.stop()

    # ---- middleware-ish checks ---------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.args.api_key
        if not key or request.url.path in OPEN_PATHS:
            return
        if not has_key(request, key):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                           error_type="authentication_error")

    def check_admin(self, request: Request) -> None:
        """Admin actions can park every slot for good: off unless a key guards them."""
        key = self.args.admin_key or self.args.api_key
        if not key:
            raise ApiError(403, "admin actions (POST /slots/{id}) are off: start the server with "
                           "--admin-key KEY (or --api-key KEY) to enable them",
                           error_type="permission_error")
        if not has_key(request, key):
            which = "admin" if self.args.admin_key else "API"
            raise ApiError(401, f"invalid or missing {which} key (Authorization: Bearer ...)",
                           error_type="authentication_error")

    def ready_stack(self) -> ServingStack:
        if self.stack is None:
            raise ApiError(503, "the model is still loading", error_type="unavailable")
        return self.stack

    # ---- routes ------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.stack is None:
            status = "error" if self.loading_error else "loading"
            return JSONResponse({"status": status, "error": self.loading_error}, 503)
        if self.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    def check_admission(self, stack: ServingStack) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", error_type="unavailable",
                           headers={"Connection": "close", "Retry-After": "5"})
        if stack.engine.num_queued + self.num_receiving >= self.args.max_queue:
            stack.metrics.rejected.inc()
            raise ApiError(503, f"the queue is full ({self.args.max_queue} requests wait for a "
                           "slot); retry later", error_type="unavailable",
                           headers={"Retry-After": "1"})

    def drain(self, timeout: float, poll: float = 0.05) -> None:
        """SIGTERM: stop admitting, let admitted requests (running, parked, queued, or still
        sending their body) finish up to `timeout`, then end what is left with an explicit
        error, and return once their responses have ended. Blocks; call it off the event loop.
        """
        self.draining = True
        if self.stack is None:
            return
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(poll)
        if not self.busy:
            return
        log.warning("shutdown timeout: ending %d unfinished requests", self.num_open)
        self.aborting = True  # read on the loop before a submit: none slips past abort_all
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.aborted.set)
        self.stack.engine.call_soon(lambda: self.stack.scheduler.abort_all(SHUT_DOWN, status=503))
        grace = time.monotonic() + DRAIN_GRACE_SECONDS
        while self.busy and time.monotonic() < grace:
            time.sleep(poll)

    @property
    def busy(self) -> bool:
        return self.num_open > 0 or (self.stack is not None and self.stack.engine.busy)

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        stack = self.ready_stack()
        return JSONResponse({"object": "list", "data": [{
            "id": stack.model_name, "object": "model", "created": self.created,
            "owned_by": "kvpark", "max_model_len": stack.max_context}]})

    async def openapi(self, request: Request) -> Response:
        stack = self.ready_stack()
        return JSONResponse(get_openapi(self.limits(stack)))

    async def metrics(self, request: Request) -> Response:
        stack = self.ready_stack()
        return Response(stack.metrics.render(), media_type="text/plain; version=0.0.4")

    async def slots(self, request: Request) -> Response:
        self.check_auth(request)
        stack = self.ready_stack()
        scheduler = stack.scheduler
        share = scheduler.pool.capacity_tokens // len(scheduler.slots)
        return JSONResponse([slot_entry(i, seq, share) for i, seq in enumerate(scheduler.slots)])

    async def slot_action(self, request: Request) -> Response:
        """POST /slots/{id}?action=park|unpark: park by the normal mode decision, or resume."""
        self.check_admin(request)
        stack = self.ready_stack()
        slots = stack.scheduler.slots
        try:
            slot_id = int(request.path_params["slot_id"])
        except ValueError:
            raise ApiError(404, "no such slot", param="id") from None
        if not 0 <= slot_id < len(slots):
            raise ApiError(404, f"no slot {protocol.clip(str(slot_id))}: there are "
                           f"{len(slots)}", param="id")
        action = request.query_params.get("action")
        if action not in ("park", "unpark"):
            raise ApiError(400, "'action': expected park or unpark", param="action")
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def act() -> None:  # on the engine thread
            seq = slots[slot_id]
            problem = None
            if seq is None:
                problem = f"slot {slot_id} is idle"
            elif action == "park" and seq.is_parked and seq.parking.manual:
                problem = f"slot {slot_id} is already parked"
            elif action == "unpark" and not seq.parking.manual:
                problem = f"slot {slot_id} was not parked by hand"
            elif action == "park":
                stack.scheduler.park_manually(seq)
            else:
                stack.scheduler.unpark(seq)
            loop.call_soon_threadsafe(done.set_result, problem)

        stack.engine.call_soon(act)
        problem = await done
        if problem:
            raise ApiError(409, problem, param="id", error_type="conflict")
        share = stack.scheduler.pool.capacity_tokens // len(slots)
        return JSONResponse(slot_entry(slot_id, slots[slot_id], share))

    async def generate(self, request: Request) -> Response:
        kind = request.scope["route_kind"]
        self.check_auth(request)
        stack = self.ready_stack()
        self.check_admission(stack)
        self.num_open += 1  # admitted: from here the drain waits for this response to end
        streaming = False
        try:
            stream = await self.read_request(request, stack, kind)
            if stream.request.stream:
                response = SSEResponse(self.stream_events(stack, stream),
                                       media_type="text/event-stream",
                                       headers={"Cache-Control": "no-cache"})
                response.on_close, streaming = self.end_request, True
                return response
            return await self.complete(request, stack, stream)
        finally:
            if not streaming:
                self.end_request()

    def end_request(self) -> None:
        self.num_open -= 1

    async def read_request(self, request: Request, stack: ServingStack,
                           kind: str) -> RequestStream:
        """Body -> request -> engine. It counts against --max-queue while its body comes in
        and is parsed (the engine's queue counts it after)."""
        self.num_receiving += 1
        try:
            raw = await read_body(request, self.args.max_body_bytes, self.args.timeout_body,
                                  self.aborted)
            with stack.metrics.preparing.track_inprogress():  # templating, tokenising: off loop
                gen = await run_in_threadpool(protocol.parse_request, kind, raw,
                                              stack.tokenizer, self.limits(stack))
            self.check_fits(stack, gen)
            if self.aborting:
                raise ApiError(503, SHUT_DOWN, error_type="unavailable",
                               headers={"Connection": "close"})
            stream = RequestStream(asyncio.get_running_loop(), stack.tokenizer, gen,
                                   f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-"
                                   f"{uuid.uuid4().hex}")
            stack.engine.submit(stream.seqs)
            return stream
        finally:
            self.num_receiving -= 1

    def limits(self, stack: ServingStack) -> InputLimits:
        return InputLimits.of(stack.max_context, self.args.max_messages,
                              self.args.max_prompt_chars)

    def check_fits(self, stack: ServingStack, gen: GenerationRequest) -> None:
        """Refuse up front what could never finish, even alone in the pool (as vLLM does)."""
        capacity = stack.scheduler.pool.capacity_tokens
        limit = min(capacity, stack.max_context)
        prompt = len(gen.prompt_ids)
        if prompt + 1 > limit:
            raise ApiError(400, f"{CONTEXT_EXCEEDED} The prompt has {prompt} tokens; one "
                           f"request can hold {limit} here (pool {capacity}).",
                           param="messages" if gen.kind == "chat" else "prompt")
        max_tokens = gen.params.max_tokens
        if max_tokens is not None and prompt + max_tokens > limit:
            name = {"chat": "max_tokens", "completion": "max_tokens", "llama": "n_predict"}
            raise ApiError(400, f"'{name[gen.kind]}': {prompt} prompt tokens + {max_tokens} to "
                           f"generate exceed the {limit} tokens one request can hold here",
                           param=name[gen.kind])
        # the n sequences are never parked, so as many as get a slot at once must fit the pool
        # together (an upper bound: with the prefix cache they share the prompt's full pages)
        pool = stack.scheduler.pool
        together = min(gen.params.n, len(stack.scheduler.slots))
        each = prompt + (max_tokens or 1)
        if together > 1 and together * pool.pages_for(each) > pool.num_pages:
            raise ApiError(400, f"'n': {together} sequences run side by side here, each up to "
                           f"{each} tokens ({prompt} prompt + {max_tokens or 1} to generate); "
                           f"together they exceed the {capacity}-token pool",
                           param="n")

    async def complete(self, request: Request, stack: ServingStack,
                       stream: RequestStream) -> Response:
        done = asyncio.ensure_future(_drain(stream))
        gone = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            for seq in stream.seqs:
                stack.engine.cancel(seq)
            return Response(status_code=499)
        gone.cancel()
        errors = [seq for seq in stream.seqs if seq.error]
        if errors:
            return error_response(seq_error(errors[0]))
        return JSONResponse(final_body(stack, stream))

    async def stream_events(self, stack: ServingStack, stream: RequestStream
                            ) -> AsyncIterator[str]:
        fmt = ChunkFormatter(stack.model_name, stream)
        finished = 0
        opened = False
        try:
            async for event in stream.events(self.args.sse_keepalive):
                if event.kind in NOTICES:  # SSE comments: clients and proxies ignore them
                    yield f": {NOTICES[event.kind]}\n\n"
                    continue
                if not opened:  # a request parked before its first token opens with a notice
                    opened = True
                    yield from_lines(fmt.opening())
                seq = stream.seqs[event.index]
                if event.kind == "text":
                    yield sse(fmt.text(event.index, event.text))
                elif event.kind == "finished":
                    finished += 1
                    if seq.error:
                        yield sse(seq_error(seq).body())
                    else:
                        yield sse(fmt.finish(seq))
            if fmt.include_usage:
                yield sse(fmt.usage())
            if stream.request.kind != "llama":
                yield sse("[DONE]")
        finally:
            if finished < len(stream.seqs):  # the client went away: free slot, pages, host RAM
                for seq in stream.seqs:
                    stack.engine.cancel(seq)


def from_lines(payloads: list[dict[str, Any]]) -> str:
    return "".join(sse(p) for p in payloads)


async def _drain(stream: RequestStream) -> None:
    async for _ in stream.events():
        pass


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def read_body(request: Request, limit: int, timeout: float,
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


def slot_entry(slot_id: int, seq: Sequence | None, share: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": slot_id, "n_ctx": share, "is_processing": seq is not None,
                             "is_preempted": False, "n_preempt": 0, "n_recompute": 0,
                             "preempt_mode": None, "task": None, "n_tokens": 0,
                             "n_prompt_tokens": 0, "n_generated": 0, "priority": 0,
                             "preempt_manual": False}
    if seq is not None:
        entry.update(
            is_preempted=seq.is_parked,
            n_preempt=seq.parking.n_preempt,
            n_recompute=seq.parking.n_recompute,
            preempt_mode=seq.parking.mode.value if seq.parking.mode else None,
            task=seq.request_id,
            n_tokens=seq.num_computed,
            n_prompt_tokens=seq.num_prompt,
            n_generated=seq.num_generated,
            priority=seq.priority,
            preempt_manual=seq.parking.manual,
            phase=("parked" if seq.is_parked else "replay" if seq.is_replaying
                   else "prompt" if seq.in_prompt else "generating"),
        )
    return entry


def final_body(stack: ServingStack, stream: RequestStream) -> dict[str, Any]:
    gen, seqs = stream.request, stream.seqs
    created = int(time.time())
    if gen.kind == "llama":
        seq = seqs[0]
        body = {"content": stream.text(0), "model": stack.model_name, "stop": True,
                "stop_type": llama_stop_type(seq, stream.outputs[0].stopped),
                "tokens_predicted": seq.num_generated,
                "tokens_evaluated": seq.num_prompt, "timings": timings(seq),
                "id_slot": seq.slot_id}
        if gen.return_tokens:
            body["tokens"] = seq.generated_ids
        body["preempt"] = stream.preempt_summary()
        return body
    if gen.kind == "chat":
        choices = [{"index": s.index, "message": {"role": "assistant",
                                                  "content": stream.text(s.index)},
                    "logprobs": None, "finish_reason": s.finish_reason} for s in seqs]
        obj = "chat.completion"
    else:
        choices = [{"index": s.index, "text": stream.text(s.index), "logprobs": None,
                    "finish_reason": s.finish_reason} for s in seqs]
        obj = "text_completion"
    return {"id": stream.request_id, "object": obj, "created": created,
            "model": stack.model_name, "choices": choices, "usage": usage(seqs),
            "timings": timings(seqs[0]), "preempt": stream.preempt_summary()}


def llama_stop_type(seq: Sequence, stopped_on_word: bool) -> str:
    """llama.cpp's stop_type: a stop string matched ("word"), the length limit, or EOS."""
    if seq.finish_reason == "length":
        return "limit"
    return "word" if stopped_on_word else "eos"


@dataclass
class ChunkFormatter:
    model: str
    stream: RequestStream

    @property
    def include_usage(self) -> bool:
        return self.stream.request.include_usage

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = self.stream.request.kind
        chunk = {"id": self.stream.request_id,
                 "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                 "created": int(time.time()), "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> list[dict[str, Any]]:
        if self.stream.request.kind != "chat":
            return []
        return [self._chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}
                             for s in self.stream.seqs])]

    def text(self, index: int, text: str) -> dict[str, Any]:
        kind = self.stream.request.kind
        if kind == "llama":
            return {"content": text, "stop": False, "index": index}
        if kind == "chat":
            return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": None,
                                 "finish_reason": None}])
        return self._chunk([{"index": index, "text": text, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, seq: Sequence) -> dict[str, Any]:
        kind = self.stream.request.kind
        if kind == "llama":
            return {"content": "", "stop": True, "index": seq.index, "model": self.model,
                    "stop_type": llama_stop_type(seq, self.stream.outputs[seq.index].stopped),
                    "tokens_predicted": seq.num_generated,
                    "tokens_evaluated": seq.num_prompt, "timings": timings(seq)}
        if kind == "chat":
            return self._chunk([{"index": seq.index, "delta": {}, "logprobs": None,
                                 "finish_reason": seq.finish_reason}])
        return self._chunk([{"index": seq.index, "text": "", "logprobs": None,
                             "finish_reason": seq.finish_reason}])

    def usage(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage(self.stream.seqs)
        return chunk


def create_app(args: ServerArgs, stack: ServingStack | None = None) -> Starlette:
    server = Server(args, stack)

    def route(path: str, kind: str) -> Route:
        async def endpoint(request: Request) -> Response:
            request.scope["route_kind"] = kind
            return await server.generate(request)

        return Route(path, endpoint, methods=["POST"])

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:  # 404, 405
        assert isinstance(exc, HTTPException)
        where = protocol.clip(f"{request.method} {request.url.path}")
        return error_response(ApiError(exc.status_code, f"{exc.detail}: {where}",
                                       headers=exc.headers))

    async def on_crash(request: Request, exc: Exception) -> Response:  # uvicorn logs the trace
        return error_response(ApiError(500, f"internal server error ({type(exc).__name__})",
                                       error_type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # load in the background so /health answers 503 while the weights come in
        loading = asyncio.create_task(server.start())
        try:
            yield
        finally:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
            server.stop()

    app = Starlette(
        routes=[
            route("/v1/chat/completions", "chat"),
            route("/v1/completions", "completion"),
            route("/completion", "llama"),
            route("/completions", "llama"),
            Route("/v1/models", server.models),
            Route("/health", server.health),
            Route("/slots", server.slots),
            Route("/slots/{slot_id}", server.slot_action, methods=["POST"]),
            Route("/metrics", server.metrics),
            Route("/openapi.json", server.openapi),
        ],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                            Exception: on_crash},
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # its redirect names the client's Host: a JSON 404
    app.state.server = server
    return app
