"""Every failure as JSON in the error shape of the APIs served: an `ApiError` as it says,
Starlette's own 404/405 naming the method and path, and a crash as a bare 500 (uvicorn logs
the trace; the client is told only the exception's type)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .request_errors import ApiError, clip


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:  # 404, 405
    assert isinstance(exc, HTTPException)
    where = clip(f"{request.method} {request.url.path}")
    return error_response(ApiError(exc.status_code, f"{exc.detail}: {where}",
                                   headers=exc.headers))


async def on_crash(request: Request, exc: Exception) -> Response:  # uvicorn logs the trace
    return error_response(ApiError(500, f"internal server error ({type(exc).__name__})",
                                   error_type="server_error"))


EXCEPTION_HANDLERS = {ApiError: on_api_error, HTTPException: on_http_error, Exception: on_crash}
