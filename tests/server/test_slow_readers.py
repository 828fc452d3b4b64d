"""A client that stops reading its stream (issue 38, 2.1): its sequence is parked once more than
`--max-stream-backlog` events wait for it, so it stops taking steps and pages from the others,
and it runs again once the client reads; what the client finally reads is what a client reading
at full speed got, token for token and logprob for logprob.

The stalled client is a raw socket with a 4 KiB receive buffer that reads nothing until told:
what the kernel holds for it is bounded by the server's send buffer (`SEND_BUFFER_BYTES`), so
the server's own queue starts to fill after a few hundred of these large chunks (20 top
logprobs each). One server: the same request read at full speed is the reference.
"""

from __future__ import annotations

import json
import socket

import h11
import pytest
from serverproc import ServerProcess, poll

BACKLOG = 64  # a client reading at full speed never falls this far behind
REQUEST = {"messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 700,
           "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
           "stream": True}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["-np", "2", "-c", "2048", "--max-stream-backlog", str(BACKLOG)]) as server:
        yield server


def payloads(body: bytes) -> list[dict]:
    """The stream's `data:` objects (comments and [DONE] left out)."""
    lines = body.decode().split("\n")
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: {")]


def tokens_and_logprobs(chunks: list[dict]) -> list[tuple]:
    """Each chunk's text and logprobs, without the per-request id and time."""
    return [(c["choices"][0]["delta"].get("content"), json.dumps(c["choices"][0]["logprobs"]))
            for c in chunks if c["choices"]]


class StalledClient:
    """A streaming request over a socket that reads nothing until `read_all`."""

    def __init__(self, port: int, body: dict) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect(("127.0.0.1", port))
        self.conn = h11.Connection(h11.CLIENT)
        data = json.dumps(body).encode()
        headers = [("Host", "127.0.0.1"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(data)))]
        self.sock.sendall(self.conn.send(h11.Request(method="POST", target="/v1/chat/completions",
                                                     headers=headers)))
        self.sock.sendall(self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage()))

    def read_all(self) -> tuple[int, bytes]:
        status, body = 0, bytearray()
        self.sock.settimeout(120)
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                self.sock.close()
                return status, bytes(body)


def test_a_stalled_reader_is_parked_and_then_reads_what_a_fast_one_got(server):
    fast = server.post("/v1/chat/completions", REQUEST)
    assert fast.status_code == 200
    reference = tokens_and_logprobs(payloads(fast.content))
    assert len(reference) == REQUEST["max_tokens"] + 2  # the role, the tokens, the finish
    assert server.metric("kvpark:n_preempt_reader_total") == 0  # a fast reader is not parked

    client = StalledClient(server.port, REQUEST)
    slot = poll(lambda: next((s for s in server.slots() if s["preempt_for_reader"]), None),
                "the stalled stream to be parked for its reader")
    assert slot["is_preempted"] and slot["n_generated"] < REQUEST["max_tokens"], slot
    # parked: it takes no steps while its client reads nothing
    assert server.slots()[slot["id"]]["n_generated"] == slot["n_generated"]
    assert server.metric("kvpark:n_preempt_reader_total") == 1

    status, body = client.read_all()  # reading lets it run again, to the end
    assert status == 200
    assert tokens_and_logprobs(payloads(body)) == reference
