"""Who may call: --api-key guards every route but the probes and the schema, --admin-key (or the
API key) the slot actions, which can park every slot for good."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from ..requests.errors import ApiError

# probes, the schema, and vLLM's /version (open there too): nothing here reveals a request
OPEN_PATHS = {"/health", "/metrics", "/openapi.json", "/version"}


def has_key(request: Request, key: str) -> bool:
    """`Authorization: Bearer KEY`, or `X-Api-Key: KEY` as Anthropic-style clients and
    llama-server's web UI send it."""
    header = request.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else ""
    if not given:
        given = request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())  # constant time


def check_auth(request: Request, api_key: str | None) -> None:
    if not api_key or request.url.path in OPEN_PATHS:
        return
    if not has_key(request, api_key):
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer ...)",
                       error_type="authentication_error")


def check_admin(request: Request, admin_key: str | None, api_key: str | None) -> None:
    """Admin actions can park every slot for good: off unless a key guards them."""
    key = admin_key or api_key
    if not key:
        raise ApiError(403, "admin actions (POST /slots/{id}) are off: start the server with "
                       "--admin-key KEY (or --api-key KEY) to enable them",
                       error_type="permission_error")
    if not has_key(request, key):
        which = "admin" if admin_key else "API"
        raise ApiError(401, f"invalid or missing {which} key (Authorization: Bearer ...)",
                       error_type="authentication_error")
