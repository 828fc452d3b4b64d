"""HTTP/1.1 by hand over a socket, for what clients libraries will not do: send the head of a
request and hold its body, stall mid-header, watch the server close the connection."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from dataclasses import dataclass, field

READ_TIMEOUT = 60.0  # a bound for each blocking read; tests wait on server state, not on this


@dataclass
class Head:
    status: int
    headers: dict[str, str]
    rest: bytes = b""  # what came after the head in the same reads


@dataclass
class RawRequest:
    """One connection; `send_head` writes a request's head with `Expect: 100-continue`, so the
    server answers `100 Continue` once it starts reading the body, or a final status first."""

    port: int
    sock: socket.socket = field(init=False)

    def __post_init__(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=READ_TIMEOUT)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_head(self, path: str, body: bytes, extra: str = "") -> None:
        self.send((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                   f"Expect: 100-continue\r\n{extra}\r\n").encode())

    def readable(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def read_head(self) -> Head:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {data!r}")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines)}
        return Head(int(status_line.split()[1]), headers, rest)

    def read_json(self, head: Head) -> dict:
        body = head.rest
        while len(body) < int(head.headers["content-length"]):
            body += self.sock.recv(65536)
        return json.loads(body)

    def response(self) -> http.client.HTTPResponse:
        """The final response, read by http.client (chunked bodies included); call it only
        after the interim `100 Continue`, if any, has been read."""
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        return response

    def is_closed_by_server(self) -> bool:
        """Blocks until the server sends something or closes; True when it closed."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def wait_readable(conns: list[RawRequest], count: int, what: str,
                  deadline: float = 60.0) -> list[RawRequest]:
    """Wait until `count` of `conns` have something to read (or were closed)."""
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        ready = [c for c in conns if c.readable()]
        if len(ready) >= count:
            return ready
        select.select([c.sock for c in conns if c not in ready], [], [], 0.05)
    raise AssertionError(f"timed out after {deadline}s waiting for {what}")
