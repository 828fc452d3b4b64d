"""The routes open without a key (`auth.OPEN_PATHS`), for probes, scrapers and client
generators: /health (503 while loading, on a failed load and while draining), /metrics,
/openapi.json."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..lifecycle import Server
from ..openapi import get_openapi


class OpenRoutes:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def health(self, request: Request) -> Response:
        server = self.server
        if server.stack is None:
            status = "error" if server.loading_error else "loading"
            return JSONResponse({"status": status, "error": server.loading_error}, 503)
        if server.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        stack = self.server.ready_stack()
        # the collector reads under the engine's lock: wait for it off the event loop
        body = await run_in_threadpool(stack.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4")

    async def openapi(self, request: Request) -> Response:
        stack = self.server.ready_stack()
        return JSONResponse(get_openapi(self.server.limits(stack)))
