"""Admission limits and SIGTERM draining of a real server process."""

import concurrent.futures as cf
import http.client
import json
import os
import signal
import subprocess
import sys

import httpx
from rawhttp import RawRequest, wait_readable
from serverproc import ServerProcess, free_port, poll


def stream_lines(url, body):
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                for line in r.iter_lines() if line.startswith("data: ")]


def sse_data(response: http.client.HTTPResponse) -> list:
    """The `data:` payloads of a raw SSE response, up to its end or a cut connection."""
    lines = []
    try:
        for raw in response:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data: "):
                lines.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    except (http.client.IncompleteRead, ConnectionError):
        lines.append("<cut>")
    return lines


def test_full_queue_gets_503_with_retry_after():
    with ServerProcess(["-np", "1", "-c", "16384", "--max-queue", "1"]) as server, \
            cf.ThreadPoolExecutor(1) as pool:
        endless = {"prompt": "run", "stream": True, "ignore_eos": True}  # runs until hung up
        with httpx.stream("POST", f"{server.url}/v1/completions", json=endless,
                          timeout=120) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept referenced: closing it would hang up
            next(line for line in lines if line.startswith("data: "))  # it holds the slot
            queued = pool.submit(server.post, "/v1/completions", {"prompt": "q", "max_tokens": 2})
            poll(lambda: server.metric("kvpark:requests_deferred") == 1, "a queued request")
            rejected = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert rejected.status_code == 503 and rejected.headers["retry-after"] == "1"
            assert "queue is full" in rejected.json()["error"]["message"]
            assert server.metric("kvpark:requests_rejected_total") == 1
        # hanging up frees the slot: the queued request runs
        assert queued.result().status_code == 200


def test_requests_count_against_the_queue_while_their_body_comes_in():
    max_queue, num = 3, 8
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    with ServerProcess(["-np", "1", "-c", "2048", "--max-queue", str(max_queue)]) as server:
        conns = [RawRequest(server.port) for _ in range(num)]
        try:
            for conn in conns:  # every head first, no body yet
                conn.send_head("/v1/completions", body)
            wait_readable(conns, num, "an answer to every head")
            heads = [(conn, conn.read_head()) for conn in conns]
            admitted = [conn for conn, head in heads if head.status == 100]  # reading the body
            refused = [(conn, head) for conn, head in heads if head.status == 503]
            assert (len(admitted), len(refused)) == (max_queue, num - max_queue)
            for conn, head in refused:
                assert head.headers["retry-after"] == "1"
                assert "queue is full" in conn.read_json(head)["error"]["message"]
            for conn in admitted:
                conn.send(body)
            assert [conn.response().status for conn in admitted] == [200] * max_queue
            assert server.metric("kvpark:requests_rejected_total") == num - max_queue
        finally:
            for conn in conns:
                conn.close()


def test_sigterm_drains_running_requests_then_exits_zero():
    server = ServerProcess(["-np", "2", "-c", "16384", "--shutdown-timeout", "60"]).start()
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            body = {"messages": [{"role": "user", "content": "long"}], "stream": True,
                    "max_tokens": 1500, "ignore_eos": True}
            stream = pool.submit(stream_lines, server.url, body)
            poll(lambda: server.metric("kvpark:requests_processing") == 1, "a running stream")
            server.proc.send_signal(signal.SIGTERM)
            poll(lambda: httpx.get(f"{server.url}/health").status_code == 503, "draining")
            refused = server.chat("too late", max_tokens=2)
            assert refused.status_code == 503 and refused.headers["connection"] == "close"
            lines = stream.result()
        assert lines[-1] == "[DONE]" and lines[-2]["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_ends_requests_admitted_before_it_whose_body_comes_late_or_never():
    """Headers before SIGTERM: admitted. A body that comes after it runs until the shutdown
    timeout and then ends with an error event and [DONE]; a body that never comes gets a 503.
    Neither is a cut connection."""
    server = ServerProcess(["-np", "2", "-c", "65536", "--shutdown-timeout", "2"]).start()
    late, never = RawRequest(server.port), RawRequest(server.port)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "late body"}],
                           "stream": True, "ignore_eos": True}).encode()
        for conn in (late, never):
            conn.send_head("/v1/chat/completions", body)
            assert conn.read_head().status == 100  # admitted: the server waits for the body
        server.proc.send_signal(signal.SIGTERM)
        poll(lambda: server.count_in_log("draining for up to"), "the drain to start")
        late.send(body)
        response = late.response()
        assert response.status == 200
        lines = sse_data(response)
        errors = [line for line in lines if isinstance(line, dict) and "error" in line]
        assert errors and "shut down" in errors[0]["error"]["message"], lines[-3:]
        assert lines[-1] == "[DONE]"
        head = never.read_head()
        assert head.status == 503 and "shut down" in never.read_json(head)["error"]["message"]
        assert server.proc.wait(60) == 0
    finally:
        late.close()
        never.close()
        server.stop(signal.SIGKILL)


def test_sigterm_timeout_ends_unfinished_requests_with_an_error():
    server = ServerProcess(["-np", "2", "-c", "65536", "--shutdown-timeout", "1"]).start()
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            body = {"messages": [{"role": "user", "content": "endless"}], "stream": True,
                    "ignore_eos": True}  # no max_tokens: it cannot finish within a second
            stream = pool.submit(stream_lines, server.url, body)
            poll(lambda: server.metric("kvpark:requests_processing") == 1, "a running stream")
            server.proc.send_signal(signal.SIGTERM)
            lines = stream.result()
        errors = [line for line in lines if isinstance(line, dict) and "error" in line]
        assert errors and "shut down" in errors[0]["error"]["message"]
        assert lines[-1] == "[DONE]"
        assert server.proc.wait(60) == 0
    finally:
        server.stop(signal.SIGKILL)


def test_bad_environment_value_exits_2_with_one_clear_line():
    env = {**os.environ, "KVPARK_PARALLEL": "0"}
    cmd = [sys.executable, "-m", "kvpark.pod", "--model", "synthetic:tiny", "--host",
           "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("kvpark-server: error: KVPARK_PARALLEL: must be positive, "
                                   "got 0 (see --help)")


def test_a_model_it_cannot_serve_exits_2_with_one_line_and_no_trace(tmp_path):
    """A Qwen3 MoE directory, as a new user would try it: one log line naming what is not
    supported and what is, exit code 2."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}))
    cmd = [sys.executable, "-m", "kvpark.pod", "--model", str(tmp_path), "--host",
           "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if "cannot serve" in line]
    assert "model_type 'qwen3_moe' is not supported" in line and "qwen3_5" in line


def test_a_config_missing_a_field_exits_2_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    cmd = [sys.executable, "-m", "kvpark.pod", "--model", str(tmp_path), "--host",
           "127.0.0.1", "--port", str(free_port())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output
    (line,) = [line for line in output.splitlines() if "cannot serve" in line]
    assert "config.json has no 'num_hidden_layers'" in line
