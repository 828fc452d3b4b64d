"""What a client is told about its request: `ApiError` (an OpenAI-style `{"error": {...}}` body
with a 4xx or 5xx status), and how an error message quotes client input (cut short, always)."""

from __future__ import annotations

import reprlib
from typing import Any

MAX_SHOWN = 100  # characters of client input an error message may quote


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.details = details or {}  # more fields of the error object
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.status, **self.details}}


def bad_field(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_SHOWN
_REPR.fillvalue = "…"  # Python 3.11+; 3.10 cuts with "..."


def clip(text: str, limit: int = MAX_SHOWN) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def shown(value: Any) -> str:
    """`repr(value)` cut short: an error message quotes client input, never all of it."""
    return clip(_REPR.repr(value))
