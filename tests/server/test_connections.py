"""Slow and idle clients: header and body read timeouts, the connection cap, the fd limit."""

import contextlib
import json
import resource
import socket

import httpx
import pytest
from rawhttp import RawRequest
from serverproc import ServerProcess, poll

BODY = json.dumps({"prompt": "slow", "max_tokens": 2}).encode()
LIMIT = 4


@pytest.fixture(scope="module")
def quick_timeouts():
    with ServerProcess(["-np", "2", "-c", "2048", "--timeout-header", "1",
                        "--timeout-body", "1"]) as server:
        yield server


@pytest.fixture(scope="module")
def capped():
    """At most LIMIT connections; header timeout long enough that only the cap closes any.
    Started under a low soft open-file limit, which the server raises to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        server = ServerProcess(["-np", str(LIMIT), "-c", "4096", "--timeout-header", "600",
                                "--max-connections", str(LIMIT)]).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield server, low, hard
    finally:
        server.stop()


def health(server) -> int | None:
    try:
        return httpx.get(f"{server.url}/health", timeout=10).status_code
    except httpx.TransportError:
        return None


def test_partial_header_is_closed_after_the_header_timeout(quick_timeouts):
    conn = RawRequest(quick_timeouts.port)
    conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    assert health(quick_timeouts) == 200  # answered while that header stalls
    assert conn.is_closed_by_server()
    idle = RawRequest(quick_timeouts.port)  # a connection that sends nothing at all
    assert idle.is_closed_by_server()
    assert health(quick_timeouts) == 200
    conn.close()
    idle.close()


def test_stalled_body_ends_with_408_and_a_closed_connection(quick_timeouts):
    conn = RawRequest(quick_timeouts.port)
    conn.send_head("/v1/completions", BODY)
    assert conn.read_head().status == 100  # admitted, reading the body
    conn.send(BODY[:5])  # then nothing more
    head = conn.read_head()
    assert head.status == 408 and head.headers["connection"] == "close"
    error = conn.read_json(head)["error"]
    assert error["type"] == "timeout" and "--timeout-body" in error["message"]
    assert conn.is_closed_by_server()
    conn.close()
    assert quick_timeouts.post("/v1/completions", json.loads(BODY)).status_code == 200


def test_the_server_raises_its_open_file_limit(capped):
    server, low, hard = capped
    soft, _ = resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE)
    assert soft == hard if hard != resource.RLIM_INFINITY else soft > low


def test_idle_connections_past_the_cap_are_shed_oldest_first(capped):
    server, _, _ = capped
    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=60)
             for _ in range(3 * LIMIT)]  # slowloris: connect, send nothing
    try:
        assert health(server) == 200  # the probe gets in: an idle connection makes room
        assert flood[0].recv(1) == b""  # the oldest was closed by the server
        assert flood[0 + LIMIT].recv(1) == b""
    finally:
        for sock in flood:
            sock.close()


def test_connections_past_the_cap_get_503_when_none_is_idle(capped):
    server, _, _ = capped
    body = {"prompt": "busy", "stream": True, "ignore_eos": True}  # runs until hung up
    with contextlib.ExitStack() as all_streams:
        lines = []  # kept referenced: closing an iterator would hang up
        for _ in range(LIMIT):  # every connection serves a request
            stream = contextlib.ExitStack()
            all_streams.enter_context(stream)
            response = stream.enter_context(httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, timeout=60))
            lines.append(response.iter_lines())
            next(line for line in lines[-1] if line.startswith("data: "))
        refused = RawRequest(server.port)
        head = refused.read_head()
        assert head.status == 503 and head.headers["retry-after"] == "1"
        assert "--max-connections" in refused.read_json(head)["error"]["message"]
        assert refused.is_closed_by_server()
        refused.close()
        stream.close()  # the last one hangs up: room for the next client
        poll(lambda: health(server) == 200, "a connection to be accepted again")
