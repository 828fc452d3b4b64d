"""A real `kvpark-server` process on an ephemeral loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import forkserver
import httpx

START_TIMEOUT = 120.0
# servers forked from one importing interpreter (forkserver.py): the test suite's conftest turns
# this on; benchmarks start and time fresh interpreters
FORK_SERVERS = False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    return values


@dataclass
class ServerProcess:
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    model: str = "synthetic:tiny"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | forkserver.AdoptedProcess | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))
    start_timeout: float = START_TIMEOUT
    # a `python -m kvpark.pod` of its own, not a fork of the suite's importing interpreter
    # (forkserver.py): for what only a fresh interpreter shows
    fresh_interpreter: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """kvpark with one torch thread unless `flags` say otherwise: tests share the cores."""
        return [sys.executable, "-m", "kvpark.pod", "--host", "127.0.0.1", "--port",
                str(self.port), "--model", self.model, "--threads", "1", *self.flags]

    @staticmethod
    def base_environment() -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1"}

    def environment(self) -> dict[str, str]:
        return {**self.base_environment(), **self.env}

    def start(self) -> ServerProcess:
        self._log = open(self.log_path, "w")
        if self.forked():
            argv = self.command()[3:]  # after `python -m kvpark.pod`
            self.proc = forkserver.fork_server(self.base_environment()).spawn(
                argv, self.environment(), self.log_path)
        else:
            self.proc = subprocess.Popen(self.command(), stdout=self._log,
                                         stderr=subprocess.STDOUT, env=self.environment())
        self.wait_healthy()
        return self

    def forked(self) -> bool:
        """Whether `start` forks it: on in the suite, and its own `env` changes nothing the
        imports read."""
        return (FORK_SERVERS and forkserver.enabled() and not self.fresh_interpreter
                and forkserver.import_time(self.environment())
                == forkserver.import_time(self.base_environment()))

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling a readiness endpoint, bounded by the deadline
        raise TimeoutError(f"server not healthy after {self.start_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def metric(self, name: str) -> float:
        return self.metrics()[name]

    def rss_bytes(self) -> int:
        """The server process's resident set size, from /proc."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc/<pid>/status")

    def slots(self, headers: dict[str, str] | None = None) -> list[dict]:
        return httpx.get(f"{self.url}/slots", headers=headers, timeout=10).json()

    def post(self, path: str, json: dict, timeout: float = 120, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=json, timeout=timeout, **kw)

    def chat(self, content: str, **params) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": content}], **params}
        return self.post("/v1/chat/completions", body)

    def count_in_log(self, pattern: str) -> int:
        return len(re.findall(pattern, self.log()))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def poll(predicate, what: str, deadline: float = 60.0):
    """Poll server state until `predicate()` is truthy and return it (bounded by `deadline`
    seconds): waiting for a condition, not sleeping for synchronisation."""
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out after {deadline}s waiting for {what}")
