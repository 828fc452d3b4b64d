"""The server's state across its life: the stack loaded in the background, the count of admitted
requests, and the drain on SIGTERM that waits for them and then ends what is left.

Every route group reads the stack, its slice of the flags (`HttpConfig`) and these counters
from the one `Server` (built by
`api.create_app`); the engine runs on its own thread and is reached through its facade only.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from ..args import ServerArgs
from ..core.messages import FinishReason
from ..requests.errors import ApiError
from ..requests.input_limits import InputLimits
from ..requests.response_store import ResponseStore
from ..serving.stack import ServingStack, build_stack, stop_stack
from .config import HttpConfig

log = logging.getLogger("kvpark.api")

DRAIN_GRACE_SECONDS = 5.0  # after the shutdown timeout: for the final error events to go out
SHUT_DOWN = "the server shut down before this request finished"


class Server:
    def __init__(self, args: ServerArgs, stack: ServingStack | None = None) -> None:
        self.args = args  # for the stack's builder; the HTTP side reads `config`
        self.config = HttpConfig.of(args)
        self.stack = stack
        self.loading_error: str | None = None
        self.exit_code = 0  # 2: a model or flag this server cannot serve; 1: a failure
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
        self.responses = ResponseStore()  # /v1/responses with `store`: previous_response_id

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        if self.stack is None:
            try:
                self.stack = await asyncio.to_thread(build_stack, self.args)
            except ValueError as exc:  # what the loader and the builder cannot serve: said
                self.loading_error, self.exit_code = str(exc), 2
                log.error("cannot serve this: %s", exc)
                self.on_load_failed()
                return
            except Exception as exc:  # anything else is a bug: its trace
                self.loading_error, self.exit_code = f"{type(exc).__name__}: {exc}", 1
                log.exception("loading the model failed")
                self.on_load_failed()
                return
        freeze_loaded_objects()
        self.stack.engine.start()
        log.info("serving %s as %s on http://%s:%d", self.stack.model_name,
                 ", ".join(self.served_names(self.stack)), self.config.host, self.config.port)

    def stop(self) -> None:
        if self.stack is not None:
            stop_stack(self.stack)

    def ready_stack(self) -> ServingStack:
        if self.stack is None:
            raise ApiError(503, "the model is still loading", error_type="unavailable")
        return self.stack

    async def drain(self, timeout: float, poll: float = 0.05) -> None:
        """SIGTERM: stop admitting, let admitted requests (running, parked, queued, or still
        sending their body) finish up to `timeout`, then end what is left with an explicit
        error, and return once their responses have ended. Runs on the event loop, as every
        request's own checks do: the counters have one thread, and no request can pass its
        `aborting` check, then submit after `abort_all` (the engine refuses that too)."""
        self.draining = True
        if self.stack is None:
            return
        deadline = time.monotonic() + timeout
        while await self.is_busy() and time.monotonic() < deadline:
            await asyncio.sleep(poll)
        if not await self.is_busy():
            return
        log.warning("shutdown timeout: ending %d unfinished requests", self.num_open)
        self.aborting = True
        self.aborted.set()
        self.stack.engine.abort_all(FinishReason.SHUTDOWN, SHUT_DOWN)
        grace = time.monotonic() + DRAIN_GRACE_SECONDS
        while await self.is_busy() and time.monotonic() < grace:
            await asyncio.sleep(poll)

    async def is_busy(self) -> bool:
        """Admitted requests open, or work in the engine (read under its locks, off the loop:
        a step may hold them)."""
        if self.num_open > 0:
            return True
        return self.stack is not None and await asyncio.to_thread(lambda: self.stack.engine.busy)

    def end_request(self) -> None:
        self.num_open -= 1

    def served_names(self, stack: ServingStack) -> tuple[str, ...]:
        return self.config.served_model_name or (stack.model_name,)

    def model_name(self, stack: ServingStack) -> str:
        """What responses echo in `model` (the first served name, as vLLM does)."""
        return self.served_names(stack)[0]

    def limits(self, stack: ServingStack) -> InputLimits:
        return InputLimits.of(stack.max_context, self.config.max_messages,
                              self.config.max_prompt_chars)


def freeze_loaded_objects() -> None:
    """Put what loading made out of the cyclic collector's sight (`gc.freeze`): the tokenizer's
    tables, the model's modules, the app's routes, objects that live as long as the server. A
    full collection while serving then walks only what requests made since; it runs on
    whichever thread allocates, the engine's too, with the GIL held, and walking every loaded
    object stalled a step for all the streams in it (benchmarks/README.md, "Python's cyclic
    collector while serving"). Reference counting still frees any of them."""
    gc.collect()
    gc.freeze()
    log.info("gc: %d objects from loading frozen (full collections skip them)",
             gc.get_freeze_count())
