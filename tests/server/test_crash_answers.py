"""A route that raises is answered 500 in the APIs' JSON error shape, and the keep-alive
connection it came on serves the next request. Real uvicorn and Starlette over loopback, with
the server's own error handling (`AnswerCrashes`, `EXCEPTION_HANDLERS`) around a route that
raises: no request of the real server is known to raise, which is the point."""

import http.client
import json
import socket
import threading

import pytest
import uvicorn
from serverproc import free_port, poll
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvpark.pod.http.error_handlers import EXCEPTION_HANDLERS, AnswerCrashes


async def crash(request):
    raise RuntimeError("a bug")


async def fine(request):
    return JSONResponse({"ok": True})


async def crash_mid_stream(request):
    async def chunks():
        yield b"data: 1\n\n"
        raise RuntimeError("a bug after the response began")

    return StreamingResponse(chunks(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def url():
    app = Starlette(routes=[Route("/crash", crash), Route("/fine", fine),
                            Route("/stream", crash_mid_stream)],
                    exception_handlers=EXCEPTION_HANDLERS, middleware=[Middleware(AnswerCrashes)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    poll(lambda: server.started, "uvicorn to start")
    yield port
    server.should_exit = True
    thread.join(30)


def test_a_crash_is_a_json_500_and_the_connection_serves_the_next_request(url):
    connection = http.client.HTTPConnection("127.0.0.1", url, timeout=30)
    for _ in range(3):
        connection.request("GET", "/crash")
        response = connection.getresponse()
        body = json.loads(response.read())
        assert response.status == 500
        assert body["error"] == {"message": "internal server error (RuntimeError)",
                                 "type": "server_error", "param": None, "code": 500}
        assert response.getheader("connection") != "close"
        connection.request("GET", "/fine")  # the same connection
        follow = connection.getresponse()
        assert follow.status == 200 and json.loads(follow.read()) == {"ok": True}


def test_a_crash_after_the_response_began_closes_the_connection(url):
    """Nothing else can be said once the status went out: the stream ends and the connection
    closes, so the client sees a cut stream rather than a hang."""
    with socket.create_connection(("127.0.0.1", url), timeout=30) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b"data: 1" in data


def test_the_servers_app_answers_crashes_itself():
    from kvpark.pod.args import parse_args
    from kvpark.pod.http.app import create_app

    app = create_app(parse_args([]))
    assert [m.cls for m in app.user_middleware][-1] is AnswerCrashes  # innermost: CORS outside
