"""Admission limits and SIGTERM draining of a real server process."""

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys

import httpx
from serverproc import ServerProcess, free_port, poll


def stream_lines(url, body):
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
                for line in r.iter_lines() if line.startswith("data: ")]


def test_full_queue_gets_503_with_retry_after():
    with ServerProcess(["-np", "1", "-c", "16384", "--max-queue", "1"]) as server, \
            cf.ThreadPoolExecutor(2) as pool:
        endless = {"prompt": "run", "max_tokens": 4000, "ignore_eos": True}
        running = pool.submit(server.post, "/v1/completions", endless)
        poll(lambda: server.metric("kvpark:requests_processing") == 1, "a running request")
        queued = pool.submit(server.post, "/v1/completions", {**endless, "max_tokens": 2})
        poll(lambda: server.metric("kvpark:requests_deferred") == 1, "a queued request")
        rejected = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert rejected.status_code == 503 and rejected.headers["retry-after"] == "1"
        assert "queue is full" in rejected.json()["error"]["message"]
        assert server.metric("kvpark:requests_rejected_total") == 1
        assert running.result().status_code == 200 and queued.result().status_code == 200


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
