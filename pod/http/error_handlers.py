"""Every failure as JSON in the error shape of the APIs served: an `ApiError` as it says,
Starlette's own 404/405 naming the method and path, and a crash as a bare 500 (the trace goes to
the log; the client is told only the exception's type) on a connection that stays usable."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..requests.errors import ApiError, clip
from .formats.anthropic import error_body

log = logging.getLogger("kvpark.api")


ANTHROPIC_PATHS = "/v1/messages"  # and /v1/messages/count_tokens: Anthropic's error shape


def error_response(exc: ApiError, path: str = "") -> JSONResponse:
    """The error in the shape of the API at `path`: Anthropic's for its routes, else OpenAI's
    (which llama-server and vLLM answer too)."""
    body = error_body(exc) if path.startswith(ANTHROPIC_PATHS) else exc.body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc, request.url.path)


async def on_http_error(request: Request, exc: Exception) -> Response:  # 404, 405
    assert isinstance(exc, HTTPException)
    where = clip(f"{request.method} {request.url.path}")
    return error_response(ApiError(exc.status_code, f"{exc.detail}: {where}",
                                   headers=exc.headers), request.url.path)


def crash_response(exc: Exception) -> JSONResponse:
    return error_response(ApiError(500, f"internal server error ({type(exc).__name__})",
                                   error_type="server_error"))


async def on_crash(request: Request, exc: Exception) -> Response:  # uvicorn logs the trace
    """The last resort (a crash outside `AnswerCrashes`, e.g. in a middleware above it)."""
    return crash_response(exc)


class AnswerCrashes:
    """A route that raises is answered 500 here. Starlette's own last resort answers and then
    raises again, and uvicorn, seeing an app fail after its response began, drops the
    connection without `Connection: close`: the client's next request on that keep-alive
    connection fails. Here the trace is logged and the connection stays open. A crash after a
    response began (mid-stream) is left to uvicorn, which can only close."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), clip(scope.get("path", "")))
            await crash_response(exc)(scope, receive, send)


EXCEPTION_HANDLERS = {ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash}
