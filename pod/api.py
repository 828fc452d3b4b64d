"""Starlette routes: OpenAI chat/completions, llama.cpp /completion, /health, /slots, /metrics,
/tokenize, /detokenize, /props.

Routes, admission and the server's lifecycle. The engine runs on its own thread and is reached
through its facade only (`engine.py`); `bridge.py` carries a request's events from that thread
into asyncio, `formats.py` shapes them for each API, `protocol.py` reads requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from . import protocol, slot_files, text_endpoints
from .args import ServerArgs
from .bridge import RequestStream, SSEResponse, StreamEvent, wait_disconnect
from .formats import failure, generation_settings, get_format
from .model.tokenizer import Tokenizer
from .openapi import get_openapi
from .protocol import ApiError, GenerationRequest, InputLimits
from .server import ServingStack, build_stack
from .slot import CONTEXT_EXCEEDED, FinishReason, SlotView

log = logging.getLogger("kvpark.api")
T = TypeVar("T")

OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}
QUIET_PATHS = {"/health", "/metrics"}  # polled every few seconds: access-logged at DEBUG only
DRAIN_GRACE_SECONDS = 5.0  # after the shutdown timeout: for the final error events to go out
SHUT_DOWN = "the server shut down before this request finished"
NOTICES = {StreamEvent.QUEUED: "queued", StreamEvent.PARKED: "preempted",
           StreamEvent.RESUMED: "resumed", StreamEvent.RECOMPUTED: "recomputed",
           StreamEvent.KEEPALIVE: "keepalive"}


def has_key(request: Request, key: str) -> bool:
    """`Authorization: Bearer KEY`, or `X-Api-Key: KEY` as Anthropic-style clients and
    llama-server's web UI send it."""
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    if not given:
        given = request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())  # constant time


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


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
        log.info("serving %s as %s on http://%s:%d", self.stack.model_name,
                 ", ".join(self.served_names(self.stack)), self.args.host, self.args.port)

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
        self.stack.engine.abort_all(FinishReason.SHUTDOWN, SHUT_DOWN)
        grace = time.monotonic() + DRAIN_GRACE_SECONDS
        while self.busy and time.monotonic() < grace:
            time.sleep(poll)

    @property
    def busy(self) -> bool:
        return self.num_open > 0 or (self.stack is not None and self.stack.engine.busy)

    def served_names(self, stack: ServingStack) -> tuple[str, ...]:
        return self.args.served_model_name or (stack.model_name,)

    def model_name(self, stack: ServingStack) -> str:
        """What responses echo in `model` (the first served name, as vLLM does)."""
        return self.served_names(stack)[0]

    def model_card(self, stack: ServingStack, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvpark",
                "root": stack.model_path, "parent": None, "max_model_len": stack.max_context}

    async def models(self, request: Request) -> Response:
        self.check_auth(request)
        stack = self.ready_stack()
        return JSONResponse({"object": "list", "data": [
            self.model_card(stack, name) for name in self.served_names(stack)]})

    async def model(self, request: Request) -> Response:
        self.check_auth(request)
        stack = self.ready_stack()
        name = request.path_params["model_id"]
        if name not in self.served_names(stack):
            raise ApiError(404, f"The model '{protocol.clip(name)}' does not exist (served: "
                           f"{', '.join(self.served_names(stack))})", param="model",
                           error_type="not_found_error")
        return JSONResponse(self.model_card(stack, name))

    async def tokenize(self, request: Request) -> Response:
        return await self.text_endpoint(request, text_endpoints.tokenize, with_limits=True)

    async def detokenize(self, request: Request) -> Response:
        return await self.text_endpoint(request, text_endpoints.detokenize)

    async def apply_template(self, request: Request) -> Response:
        return await self.text_endpoint(request, text_endpoints.apply_template,
                                        with_limits=True)

    async def text_endpoint(self, request: Request, answer: Any,
                            with_limits: bool = False) -> Response:
        """A tokenizer endpoint: body -> answer off the event loop (templating and
        tokenising a long text is CPU-bound)."""
        self.check_auth(request)
        stack = self.ready_stack()
        body = await self.read_json(request)
        extra = (self.limits(stack),) if with_limits else ()
        return JSONResponse(await run_in_threadpool(answer, body, stack.tokenizer, *extra))

    async def version(self, request: Request) -> Response:
        """vLLM's /version."""
        return JSONResponse({"version": build_version()})

    async def props(self, request: Request) -> Response:
        """llama.cpp's /props: what a client needs to know before it sends a request."""
        self.check_auth(request)
        stack = self.ready_stack()
        return JSONResponse({
            "default_generation_settings": {
                "id": 0, "id_task": -1, "n_ctx": slot_share(stack), "speculative": False,
                "is_processing": False, "model": self.model_name(stack),
                "params": default_params(stack)},
            "total_slots": stack.engine.capacity.num_slots,
            "model_path": stack.model_path,
            "model_alias": self.model_name(stack),
            "chat_template": stack.tokenizer.chat_template or "",
            "bos_token": special_text(stack.tokenizer, stack.tokenizer.bos_token_id),
            "eos_token": special_text(stack.tokenizer, stack.tokenizer.eos_token_id),
            "build_info": f"kvpark {build_version()}",
            "modalities": {"vision": False, "audio": False},
        })

    async def embeddings(self, request: Request) -> Response:
        self.check_auth(request)
        stack = self.ready_stack()
        # as vLLM answers a generation model: 400, not a 404 that reads as a wrong URL
        raise ApiError(400, f"The model does not support Embeddings API: "
                       f"{self.model_name(stack)} is a text generation model", param="model")

    async def read_json(self, request: Request) -> dict[str, Any]:
        raw = await read_body(request, self.args.max_body_bytes, self.args.timeout_body,
                              self.aborted)
        return protocol.decode_body(raw)

    async def openapi(self, request: Request) -> Response:
        stack = self.ready_stack()
        return JSONResponse(get_openapi(self.limits(stack)))

    async def metrics(self, request: Request) -> Response:
        stack = self.ready_stack()
        # the collector reads under the engine's lock: wait for it off the event loop
        body = await run_in_threadpool(stack.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4")

    async def slots(self, request: Request) -> Response:
        self.check_auth(request)
        stack = self.ready_stack()
        share = slot_share(stack)
        return JSONResponse([slot_entry(i, view, share)
                             for i, view in enumerate(await snapshot(stack))])

    async def slot_action(self, request: Request) -> Response:
        """POST /slots/{id}?action=park|unpark: park by the normal mode decision, or resume;
        save|restore|erase: llama-server's slot files (`slot_file_action`)."""
        self.check_admin(request)
        stack = self.ready_stack()
        num_slots = stack.engine.capacity.num_slots
        try:
            slot_id = int(request.path_params["slot_id"])
        except ValueError:
            raise ApiError(404, "no such slot", param="id") from None
        if not 0 <= slot_id < num_slots:
            raise ApiError(404, f"no slot {protocol.clip(str(slot_id))}: there are "
                           f"{num_slots}", param="id")
        action = request.query_params.get("action")
        if action in ("save", "restore", "erase"):
            return await self.slot_file_action(request, stack, slot_id, action)
        if action not in ("park", "unpark"):
            raise ApiError(400, "'action': expected park, unpark, save, restore or erase",
                           param="action")
        act = stack.engine.park_slot if action == "park" else stack.engine.unpark_slot
        problem = await asyncio.wrap_future(act(slot_id))
        if problem:
            raise ApiError(409, problem, param="id", error_type="conflict")
        return JSONResponse(slot_entry(slot_id, (await snapshot(stack))[slot_id],
                                       slot_share(stack)))

    async def slot_file_action(self, request: Request, stack: ServingStack, slot_id: int,
                               action: str) -> Response:
        """llama-server's answers. The pages are copied on the engine thread; the file is
        written and read in a worker thread, never on the event loop or under the engine lock."""
        started = time.perf_counter()
        engine = stack.engine
        if action == "erase":  # touches no file: needs no --slot-save-path
            erased = await slot_outcome(engine.erase_slot(slot_id))
            return JSONResponse({"id_slot": slot_id, "n_erased": erased})
        if not self.args.slot_save_path:
            raise ApiError(400, f"this server does not support slots action {action!r}: start "
                           "it with --slot-save-path DIR", param="action",
                           error_type="not_supported_error")
        body = await self.read_json(request)
        name = body.get("filename")
        try:
            path = slot_files.resolve_name(self.args.slot_save_path, name)
            if action == "save":
                state = await slot_outcome(engine.save_slot(slot_id))
                size = await asyncio.to_thread(slot_files.write, path, stack.identity, state)
            else:
                state, size = await asyncio.to_thread(slot_files.read, path, stack.identity,
                                                      stack.kv_dtype)
                await slot_outcome(engine.restore_slot(slot_id, state))
        except slot_files.SlotFileError as exc:
            raise ApiError(exc.status, str(exc), param="filename") from None
        ms = (time.perf_counter() - started) * 1000
        if action == "save":
            return JSONResponse({"id_slot": slot_id, "filename": name,
                                 "n_saved": len(state.tokens), "n_written": size,
                                 "timings": {"save_ms": ms}})
        return JSONResponse({"id_slot": slot_id, "filename": name,
                             "n_restored": len(state.tokens), "n_read": size,
                             "timings": {"restore_ms": ms}})

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
                gens = await run_in_threadpool(protocol.parse_requests, kind, raw,
                                               stack.tokenizer, self.limits(stack),
                                               stack.defaults)
            for i, gen in enumerate(gens):
                self.check_fits(stack, gen, f"[{i}]" if len(gens) > 1 else "")
            if self.aborting:
                raise ApiError(503, SHUT_DOWN, error_type="unavailable",
                               headers={"Connection": "close"})
            request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            stream = merge_streams([RequestStream(asyncio.get_running_loop(), stack.tokenizer,
                                                  gen, request_id) for gen in gens])
            stack.engine.submit(stream.seqs)
            return stream
        finally:
            self.num_receiving -= 1

    def limits(self, stack: ServingStack) -> InputLimits:
        return InputLimits.of(stack.max_context, self.args.max_messages,
                              self.args.max_prompt_chars)

    def check_fits(self, stack: ServingStack, gen: GenerationRequest, which: str = "") -> None:
        """Refuse up front what could never finish, even alone in the pool (as vLLM does).
        `which`: the prompt's place in a batched `prompt` ("[2]")."""
        room = stack.engine.capacity
        capacity = room.tokens
        limit = min(capacity, stack.max_context)
        prompt = len(gen.prompt_ids)
        if prompt + 1 > limit:
            # llama.cpp's type and numbers: a client branches on them, not on the words
            raise ApiError(400, f"{CONTEXT_EXCEEDED} The prompt has {prompt} tokens; one "
                           f"request can hold {limit} here (pool {capacity}).",
                           param="messages" if gen.kind == "chat" else f"prompt{which}",
                           error_type="exceed_context_size_error",
                           details={"n_prompt_tokens": prompt, "n_ctx": limit})
        max_tokens = gen.params.max_tokens
        if max_tokens is not None and prompt + max_tokens > limit:
            name = {"chat": "max_tokens", "completion": "max_tokens", "llama": "n_predict"}
            raise ApiError(400, f"'{name[gen.kind]}': {prompt} prompt tokens + {max_tokens} to "
                           f"generate exceed the {limit} tokens one request can hold here",
                           param=name[gen.kind])
        # the n sequences are never parked, so as many as get a slot at once must fit the pool
        # together (with the prefix cache they share the prompt's full pages)
        together = min(gen.params.n, room.num_slots)
        each = prompt + (max_tokens or 1)
        if together > 1 and room.pages_for_family(together, prompt, each) > room.num_pages:
            raise ApiError(400, f"'n': {together} sequences run side by side here, each up to "
                           f"{each} tokens ({prompt} prompt + {max_tokens or 1} to generate); "
                           f"together they exceed the {capacity}-token pool",
                           param="n")

    async def complete(self, request: Request, stack: ServingStack,
                       stream: RequestStream) -> Response:
        done = asyncio.ensure_future(stream.wait_finished())
        gone = asyncio.ensure_future(wait_disconnect(request))
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            done.cancel()
            for seq in stream.seqs:
                stack.engine.cancel(seq)
            return Response(status_code=499)
        gone.cancel()
        failed = [seq for seq in stream.seqs if seq.failed]
        if failed:
            return error_response(failure(failed[0]))
        return JSONResponse(get_format(self.model_name(stack), stream,
                                       fingerprint(stack)).body())

    async def stream_events(self, stack: ServingStack, stream: RequestStream
                            ) -> AsyncIterator[str]:
        fmt = get_format(self.model_name(stack), stream, fingerprint(stack))
        finished = 0
        opened = False
        try:
            async for event in stream.events(self.args.sse_keepalive):
                fmt.observe(event)
                if event.kind in NOTICES:  # SSE comments: clients and proxies ignore them
                    yield f": {NOTICES[event.kind]}\n\n"
                    continue
                if not opened:  # a request parked before its first token opens with a notice
                    opened = True
                    yield from_lines(fmt.opening())
                seq = stream.seqs[event.index]
                if event.kind is StreamEvent.PROGRESS:
                    yield sse(fmt.progress(event.progress))
                elif event.kind is StreamEvent.TEXT:
                    yield sse(fmt.text(event.index, event.text, event.num_logprobs))
                elif event.kind is StreamEvent.FINISHED:
                    finished += 1
                    if seq.failed:
                        yield sse(failure(seq).body())
                    else:
                        yield from_lines(fmt.finish_chunks(seq))
            if fmt.include_usage:
                yield sse(fmt.usage())
            if fmt.ends_with_done:
                yield sse("[DONE]")
        finally:
            if finished < len(stream.seqs):  # the client went away: free slot, pages, host RAM
                for seq in stream.seqs:
                    stack.engine.cancel(seq)


def merge_streams(streams: list[RequestStream]) -> RequestStream:
    """A batched `prompt` as one stream: prompt p's j-th choice is choice p * n + j (OpenAI's
    order), and all of them report to the first stream's queue."""
    first = streams[0]
    n = first.request.params.n
    for p, stream in enumerate(streams[1:], 1):
        for seq in stream.seqs:
            if seq.index in stream.echoes:
                first.echoes[p * n + seq.index] = stream.echoes[seq.index]
            seq.index = p * n + seq.index
            seq.request_id = f"{first.request_id}/{seq.index}"
            seq.on_event = first.on_event
            first.seqs.append(seq)
    if len(streams) > 1 and n == 1:
        first.seqs[0].request_id = f"{first.request_id}/0"
    return first


def special_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)


def fingerprint(stack: ServingStack) -> str:
    """OpenAI's system_fingerprint: changes when the build or anything deciding the numbers
    (weights, precision, kernels) does, so a client pairing it with `seed` sees why."""
    digest = hashlib.sha256(f"{build_version()}|{stack.numerics}".encode()).hexdigest()
    return f"fp_{digest[:10]}"


def build_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvpark")
    except PackageNotFoundError:
        return "unknown"


class QuietPolls(logging.Filter):
    """Drops access-log lines of /health and /metrics polls unless the log level is DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        if args[2].split("?", 1)[0] not in QUIET_PATHS:
            return True
        return logging.getLogger("kvpark").isEnabledFor(logging.DEBUG)


def quiet_polls() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietPolls) for f in access.filters):
        access.addFilter(QuietPolls())


def from_lines(payloads: list[dict[str, Any]]) -> str:
    return "".join(sse(p) for p in payloads)


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


async def slot_outcome(future: concurrent.futures.Future[T | str]) -> T:
    """What an engine slot action gave back; a string says why not: 409."""
    result = await asyncio.wrap_future(future)
    if isinstance(result, str):
        raise ApiError(409, result, param="id", error_type="conflict")
    return result


async def snapshot(stack: ServingStack) -> list[SlotView | None]:
    """The slots, read under the engine's lock off the event loop (a step may hold it)."""
    return await run_in_threadpool(stack.engine.snapshot)


def default_params(stack: ServingStack) -> dict[str, Any]:
    """/props' `params` in llama.cpp's names: what a request that sets nothing gets."""
    params = protocol.sampling_params(stack.defaults.under({}, stack.max_context),
                                      stack.max_context, ("max_tokens",), stack.tokenizer)
    return generation_settings(params)


def slot_share(stack: ServingStack) -> int:
    capacity = stack.engine.capacity
    return capacity.tokens // capacity.num_slots


def slot_entry(slot_id: int, view: SlotView | None, share: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": slot_id, "n_ctx": share, "is_processing": view is not None,
                             "is_preempted": False, "n_preempt": 0, "n_recompute": 0,
                             "preempt_mode": None, "task": None, "n_tokens": 0,
                             "n_prompt_tokens": 0, "n_generated": 0, "priority": 0,
                             "preempt_manual": False, "resumed_from": []}
    if view is not None:
        entry.update(
            is_preempted=view.parked, n_preempt=view.n_preempt, n_recompute=view.n_recompute,
            preempt_mode=view.preempt_mode, task=view.request_id, n_tokens=view.num_computed,
            n_prompt_tokens=view.num_prompt, n_generated=view.num_generated,
            priority=view.priority, preempt_manual=view.manual, phase=view.phase,
            resumed_from=list(view.resumed_from))
    return entry


def cors(origins: tuple[str, ...]) -> list[Middleware]:
    """--cors-origin: browsers on those origins may call the API (off unless given)."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                       allow_headers=["*"], allow_credentials="*" not in origins,
                       max_age=600)]


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
        quiet_polls()  # after uvicorn configured its loggers
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
            route("/chat/completions", "chat"),
            route("/v1/completions", "completion"),
            route("/completion", "llama"),
            route("/completions", "llama"),  # llama.cpp's alias of /completion, its shape too
            Route("/v1/models", server.models),
            Route("/models", server.models),
            Route("/v1/models/{model_id:path}", server.model),
            Route("/models/{model_id:path}", server.model),
            Route("/tokenize", server.tokenize, methods=["POST"]),
            Route("/detokenize", server.detokenize, methods=["POST"]),
            Route("/apply-template", server.apply_template, methods=["POST"]),
            Route("/version", server.version),
            Route("/props", server.props),
            Route("/v1/embeddings", server.embeddings, methods=["POST"]),
            Route("/embeddings", server.embeddings, methods=["POST"]),
            Route("/health", server.health),
            Route("/slots", server.slots),
            Route("/slots/{slot_id}", server.slot_action, methods=["POST"]),
            Route("/metrics", server.metrics),
            Route("/openapi.json", server.openapi),
        ],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                            Exception: on_crash},
        lifespan=lifespan,
        middleware=cors(args.cors_origin),
    )
    app.router.redirect_slashes = False  # its redirect names the client's Host: a JSON 404
    app.state.server = server
    return app
