"""The pure parts of the connection guards: the throttled accept-error log, the limits, the
access log's redacted query values."""

import errno
import logging
import resource

from kvpark.pod.__main__ import graceful_timeout
from kvpark.pod.args import parse_args
from kvpark.pod.http.connections import (
    AcceptErrorLog,
    RedactedQueries,
    get_limits,
    raise_fd_limit,
    redact_query,
)
from kvpark.pod.http.lifecycle import DRAIN_GRACE_SECONDS


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeLoop:
    def __init__(self) -> None:
        self.passed_on: list[dict] = []

    def default_exception_handler(self, context: dict) -> None:
        self.passed_on.append(context)


def test_out_of_fds_on_accept_is_logged_once_per_period(caplog):
    clock, loop = FakeClock(), FakeLoop()
    handler = AcceptErrorLog(seconds=10, clock=clock)
    emfile = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.ERROR, logger="kvpark.connections"):
        for _ in range(2560):  # 20 s of accept() failing every 1/128 s (exact in binary)
            handler(loop, {"message": "socket.accept() out of system resource",
                           "exception": emfile})
            clock.now += 1 / 128
    records = [r for r in caplog.records if r.name == "kvpark.connections"]
    assert len(records) == 2
    assert all("Too many open files" in r.getMessage() and not r.exc_info for r in records)
    assert "1279 more" in records[1].getMessage()
    assert loop.passed_on == []


def test_other_loop_errors_keep_the_default_handler():
    loop = FakeLoop()
    context = {"message": "boom", "exception": ValueError("boom")}
    AcceptErrorLog()(loop, context)
    AcceptErrorLog()(loop, {"message": "reset", "exception": OSError(errno.ECONNRESET, "x")})
    assert loop.passed_on[0] is context and len(loop.passed_on) == 2


def test_connection_cap_fits_the_open_file_limit():
    args = parse_args([], env={})
    assert (args.timeout_header, args.timeout_body, args.max_connections) == (10.0, 30.0, 4096)
    assert get_limits(args, 1 << 20).max_connections == 4096
    small = get_limits(args, 1024)
    assert small.max_connections + small.backlog + 256 <= 1024
    asked = parse_args(["--max-connections", "8", "--timeout-header", "2"], env={})
    limits = get_limits(asked, 1 << 20)
    assert (limits.max_connections, limits.timeout_header, limits.backlog) == (8, 2.0, 8)


def test_soft_open_file_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    try:
        raised = raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_uvicorn_waits_longer_than_the_drain():
    for timeout in (0.0, 1.0, 8.0, 30.0):
        assert graceful_timeout(timeout) >= timeout + DRAIN_GRACE_SECONDS


def test_access_log_query_values_are_redacted_and_names_kept():
    assert redact_query("/v1/models") == "/v1/models"
    assert redact_query("/v1/models?api_key=K&x&&y=") == \
        "/v1/models?api_key=[redacted]&[redacted]&&y=[redacted]"
    # uvicorn's access record: (client, method, path with query, HTTP version, status)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                               '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:1", "GET", "/v1/models?key=K", "1.1", 401), None)
    assert RedactedQueries().filter(record)
    assert record.getMessage() == '127.0.0.1:1 - "GET /v1/models?key=[redacted] HTTP/1.1" 401'
