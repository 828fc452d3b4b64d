"""Starlette routes: OpenAI chat/completions, llama.cpp /completion, /health, /slots, /metrics,
/tokenize, /detokenize, /props.

The app's wiring: which path goes to which route group, the error handlers, CORS, and the
lifespan that loads the model in the background. The groups share one `Server`
(`lifecycle.py`: the stack, the admitted-request counts, the drain); the engine runs on its own
thread and is reached through its facade only (`core/engine.py`); a request's events come from
that thread as values (`core/messages.py`) into its `stream.py`, `formats/` shapes them for each
API, `requests/parsers.py` reads requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..args import ServerArgs
from ..serving.stack import ServingStack
from .error_handlers import EXCEPTION_HANDLERS, AnswerCrashes
from .lifecycle import Server
from .routes.generation import GenerationRoutes
from .routes.models import ModelRoutes
from .routes.open import OpenRoutes
from .routes.slots import SlotRoutes

QUIET_PATHS = {"/health", "/metrics"}  # polled every few seconds: access-logged at DEBUG only


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


def cors(origins: tuple[str, ...]) -> list[Middleware]:
    """--cors-origin: browsers on those origins may call the API (off unless given)."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                       allow_headers=["*"], allow_credentials="*" not in origins,
                       max_age=600)]


def get_generation_routes(generation: GenerationRoutes) -> list[Route]:
    def route(path: str, kind: str) -> Route:
        async def endpoint(request: Request) -> Response:
            request.scope["route_kind"] = kind
            return await generation.generate(request)

        return Route(path, endpoint, methods=["POST"])

    return [
        route("/v1/chat/completions", "chat"),
        route("/chat/completions", "chat"),
        route("/v1/completions", "completion"),
        route("/completion", "llama"),
        route("/completions", "llama"),  # llama.cpp's alias of /completion, its shape too
        route("/v1/messages", "messages"),  # Anthropic's Messages API
        route("/v1/responses", "responses"),  # OpenAI's Responses API
        route("/responses", "responses"),  # llama-server serves it there too
    ]


def get_routes(server: Server) -> list[Route]:
    models, slots, open_ = ModelRoutes(server), SlotRoutes(server), OpenRoutes(server)
    return get_generation_routes(GenerationRoutes(server)) + [
        Route("/v1/models", models.models),
        Route("/models", models.models),
        Route("/v1/models/{model_id:path}", models.model),
        Route("/models/{model_id:path}", models.model),
        Route("/tokenize", models.tokenize, methods=["POST"]),
        Route("/v1/messages/count_tokens", models.count_message_tokens, methods=["POST"]),
        Route("/detokenize", models.detokenize, methods=["POST"]),
        Route("/apply-template", models.apply_template, methods=["POST"]),
        Route("/tokenizer_info", models.tokenizer_info),
        Route("/version", models.version),
        Route("/props", models.props),
        Route("/v1/embeddings", models.embeddings, methods=["POST"]),
        Route("/embeddings", models.embeddings, methods=["POST"]),
        Route("/health", open_.health),
        Route("/slots", slots.slots),
        Route("/slots/{slot_id}", slots.slot_action, methods=["POST"]),
        Route("/metrics", open_.metrics),
        Route("/openapi.json", open_.openapi),
    ]


def create_app(args: ServerArgs, stack: ServingStack | None = None) -> Starlette:
    server = Server(args, stack)

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
        routes=get_routes(server),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
        middleware=[*cors(args.cors_origin), Middleware(AnswerCrashes)],
    )
    app.router.redirect_slashes = False  # its redirect names the client's Host: a JSON 404
    app.state.server = server
    return app
