"""HTTP connection guards uvicorn does not have: a header read timeout, a cap on open
connections that sheds idle ones first, the open-file limit, a quiet log when accept()
runs out of file descriptors, and query values kept out of the access log.

uvicorn's `limit_concurrency` is not used: it answers every request (/health included) with
503 once the cap is reached and still accepts the connections, so it neither frees file
descriptors nor keeps a liveness probe answering. Here a connection past the cap closes the
oldest connection that has no request in progress (idle keep-alive, a header still coming in,
or a response sent while a body is still arriving), and only when every connection is serving
a request does the new one get 503. The path is unknown until the header has come, so /health
is not exempt by name; requests in progress are bounded by --max-queue and the slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..args import ServerArgs

log = logging.getLogger("kvpark.connections")

LOG_EVERY_SECONDS = 10.0  # one report per this long for floods of the same trouble
FD_RESERVE = 256  # model files, pipes, threads, the listening socket, log files
MAX_BACKLOG = 2048  # uvicorn's default; accepted-but-unseen connections hold fds too
# what the kernel may hold of a connection's unread output (Linux doubles it for bookkeeping):
# with autotuning a client that stops reading parks up to 4 MiB there, ~20,000 streamed tokens
# before the server could notice (--max-stream-backlog counts what is queued behind it).
# Token streams need little bandwidth; a large body still flows at this over the round trip.
SEND_BUFFER_BYTES = 256 << 10
OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
REDACTED = "[redacted]"


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    timeout_header: float
    backlog: int


@dataclass
class Throttle:
    """Lets a report through at most once per `seconds`; counts the ones held back."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    last: float = -math.inf
    held: int = 0

    def allow(self) -> int | None:
        """None to stay quiet, else how many were held back since the last report."""
        now = self.clock()
        if now - self.last < self.seconds:
            self.held += 1
            return None
        held, self.held, self.last = self.held, 0, now
        return held


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (each connection is a descriptor); the result."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def get_limits(args: ServerArgs, fd_limit: int) -> ConnectionLimits:
    """--max-connections, lowered so that connections plus the accept backlog plus a reserve
    stay under the open-file limit."""
    fits = max(16, (fd_limit - FD_RESERVE) // 2)
    num = min(args.max_connections, fits)
    if num < args.max_connections:
        log.warning("--max-connections %d lowered to %d to fit the open-file limit %d",
                    args.max_connections, num, fd_limit)
    return ConnectionLimits(num, args.timeout_header, backlog=min(MAX_BACKLOG, num))


def refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"too many open connections (--max-connections {max_connections}); "
                   "retry later", "type": "unavailable", "param": None, "code": 503}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body))


def bound_send_buffer(transport: asyncio.Transport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a platform that refuses keeps its default
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a header read timeout and the connection cap."""

    limits: ClassVar[ConnectionLimits]
    idle: ClassVar[dict[GuardedH11Protocol, None]]  # no request in progress; oldest first
    shed_log: ClassVar[Throttle]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._shed_idle():
            transport.write(refusal(self.limits.max_connections))
            transport.close()
            return
        self.idle[self] = None
        bound_send_buffer(transport)
        self._watch_header()

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.pop(self, None)
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def _track(self) -> None:
        busy = self.cycle is not None and not self.cycle.response_complete
        if busy:
            self.idle.pop(self, None)
        elif self not in self.idle and not self.transport.is_closing():
            self.idle[self] = None  # back to idle: the youngest
        self._watch_header()

    def _shed_idle(self) -> bool:
        victim = next((c for c in self.idle if c is not self), None)
        held = self.shed_log.allow()
        if held is not None:
            log.warning("%d connections open (--max-connections): %s%s",
                        len(self.connections), "closing the oldest idle one" if victim else
                        "refusing new ones with 503", f" ({held} more since)" if held else "")
        if victim is None:
            return False
        self.idle.pop(victim)
        victim._cancel_header_timer()
        victim.transport.close()
        return True

    def _watch_header(self) -> None:
        """A request's header must be complete within --timeout-header of its first byte (of
        the connection, for a new one); the keep-alive timeout covers the wait before that."""
        waiting = (self.conn.their_state is h11.IDLE and not self.transport.is_closing()
                   and (self.timeout_keep_alive_task is None or self.header_timer is not None))
        if not waiting:
            self._cancel_header_timer()
        elif self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.timeout_header,
                                                     self._header_timed_out)

    def _header_timed_out(self) -> None:
        self.header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing a connection whose request header did not come within %g s",
                      self.limits.timeout_header)
            self.transport.close()

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None


def make_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server, with its own limits and its own idle list."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "idle": {}, "shed_log": Throttle(LOG_EVERY_SECONDS)})


class AcceptErrorLog:
    """Event loop exception handler: accept() out of file descriptors retries every second
    and would log a traceback each time; report it once per `seconds`, without one."""

    def __init__(self, seconds: float = LOG_EVERY_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.throttle = Throttle(seconds, clock)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in OUT_OF_FDS):
            loop.default_exception_handler(context)
            return
        held = self.throttle.allow()
        if held is not None:
            log.error("%s: %s%s", context.get("message", "socket error"), exc.strerror,
                      f" ({held} more in the last {self.throttle.seconds:g} s)" if held else "")


class RedactedQueries(logging.Filter):
    """Writes every query value in uvicorn's access log as [redacted], keeping the names.
    Clients put keys in query strings (`?api_key=...`, `?key=...`) although only the
    Authorization header is read, and keys are never logged; which names carry one cannot be
    known, so no value is written."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, HTTP version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def redact_query(path: str) -> str:
    """`/v1/models?api_key=K&x` -> `/v1/models?api_key=[redacted]&[redacted]`: a part without
    `=` may itself be the key."""
    path, mark, query = path.partition("?")
    if not mark:
        return path
    return f"{path}?" + "&".join(_redact_part(part) for part in query.split("&"))


def _redact_part(part: str) -> str:
    name, eq, _ = part.partition("=")
    if eq:
        return f"{name}={REDACTED}"
    return REDACTED if part else part


def redact_access_log() -> None:
    """Once uvicorn has configured its loggers (its Config does)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactedQueries) for f in access.filters):
        access.addFilter(RedactedQueries())
