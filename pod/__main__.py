"""`python -m kvpark.pod` / `kvpark-server`: serve a model over HTTP."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import sys

import uvicorn

from .args import parse_args
from .http.app import create_app
from .http.connections import (
    AcceptErrorLog,
    get_limits,
    make_protocol,
    raise_fd_limit,
    redact_access_log,
)
from .http.lifecycle import DRAIN_GRACE_SECONDS, Server

log = logging.getLogger("kvpark")


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first SIGTERM/SIGINT: stop admitting, finish running and
    parked requests (up to --shutdown-timeout), then exit. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, api: Server, timeout: float) -> None:
        super().__init__(config)
        self.api = api
        self.timeout = timeout
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # set at startup
        self.drains: set[asyncio.Task[None]] = set()  # held: a task nobody holds may vanish

    def handle_exit(self, sig: int, frame: object) -> None:
        if self.draining:
            self.config.timeout_graceful_shutdown = 0  # not --shutdown-timeout again
            super().handle_exit(sig, frame)
            return
        self.draining = True
        if self.loop is None:  # before startup: nothing was admitted
            super().handle_exit(sig, frame)
            return
        log.info("signal %d: draining for up to %.0f s", sig, self.timeout)
        # a signal handler may not await: the drain is a task on the event loop
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        assert self.loop is not None
        self.drains.add(self.loop.create_task(self._drain_then_exit()))

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(AcceptErrorLog())
        await super().startup(sockets)

    async def _drain_then_exit(self) -> None:
        await self.api.drain(self.timeout)
        self.should_exit = True


def graceful_timeout(shutdown_timeout: float) -> int:
    """uvicorn's own cap on open connections at exit. The drain has ended every admitted
    request by then, so this only binds if that went wrong; it must never cut the drain's
    final error events short."""
    return math.ceil(shutdown_timeout + 2 * DRAIN_GRACE_SECONDS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("%r", args)
    app = create_app(args)
    api: Server = app.state.server
    fd_limit = raise_fd_limit()
    limits = get_limits(args, fd_limit)
    log.info("connections: at most %d (open-file limit %d), header timeout %g s, body timeout "
             "%g s", limits.max_connections, fd_limit, args.timeout_header, args.timeout_body)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=make_protocol(limits), backlog=limits.backlog,
                            timeout_graceful_shutdown=graceful_timeout(args.shutdown_timeout))
    redact_access_log()  # after uvicorn.Config: it configures uvicorn's loggers
    server = DrainingServer(config, api, args.shutdown_timeout)

    def exit_on_load_failure() -> None:
        server.should_exit = True

    api.on_load_failed = exit_on_load_failure
    server.run()
    return api.exit_code


if __name__ == "__main__":
    sys.exit(main())
