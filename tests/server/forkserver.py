"""Test servers forked from an interpreter that has imported the server once.

Most of a test server's start-up is `python -m kvpark.pod` importing torch and the server's
modules: the same seconds of CPU for each of the suite's few hundred servers, on two cores the
servers' real work shares. A fork server imports them once per test process; each server is
then a fork of it that runs the same `main(argv)` a fresh interpreter runs: its own process,
real HTTP on its own port, its own log, signals and exit codes as before.

Where it differs from a fresh interpreter, and how the suite keeps that out of the tests:
- environment read while importing (the OpenMP runtime reads OMP_NUM_THREADS as torch loads
  it) is the fork server's; a server whose own `env` sets such a variable otherwise starts as
  a fresh interpreter (`ServerProcess.forked`), and a fork server is started anew where the test
  process's own environment has changed one (`fork_server`);
- the interpreter's own start (site, `-m` path handling, `sys.argv[0]`) is the fork server's;
  the tests of the command line itself run `python -m kvpark.pod` or the console script in a
  subprocess of their own;
- the servers of one test process share the fork server's string-hash seed, where fresh
  interpreters each draw their own: an output that depended on the order of a set of strings
  would agree between two forked servers (it still differs between test processes and runs;
  `test_forkserver.py` compares a forked server's bytes with a fresh one's);
- a server is a grandchild of the test process adopted through PR_SET_CHILD_SUBREAPER: the test
  process reaps it, so `AdoptedProcess` gives the parts of `subprocess.Popen` the tests use.

Set KVPARK_TEST_FORKSERVER=0 to start every server as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
ENABLED_ENV = "KVPARK_TEST_FORKSERVER"
# read while torch and its runtimes load, before a server's own environment could apply
IMPORT_TIME_ENV = ("OMP_", "KMP_", "MKL_", "GOMP_", "ONEDNN_", "DNNL_", "LD_", "PYTHON",
                   "MALLOC_", "TORCH_", "OPENBLAS_")


def enabled() -> bool:
    return os.environ.get(ENABLED_ENV, "1") != "0" and has_pidfd()


@functools.cache
def has_pidfd() -> bool:
    """Whether this kernel waits on another process's exit through a pidfd (Linux 5.3 on)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def import_time(env: dict[str, str]) -> dict[str, str]:
    """The variables of `env` read while the server's modules are imported: a fork inherits
    the fork server's."""
    return {key: value for key, value in env.items() if key.startswith(IMPORT_TIME_ENV)}


@dataclass
class AdoptedProcess:
    """A server this process reaps (it is the subreaper the server's parent exited under): the
    parts of `subprocess.Popen` the tests use."""

    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            exited = os.pidfd_open(self.pid)  # readable once the process has exited
            try:
                if not select.select([exited], [], [], timeout)[0]:
                    raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
            finally:
                os.close(exited)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The importing interpreter, started on first use and ended when this process exits."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        self.path = Path(tempfile.mkdtemp(prefix="kvpark-forkserver-")) / "socket"
        # its stdin is a pipe nobody writes: it ends (and so does the fork server) when this
        # process does, however it ends
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.path)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready = self.proc.stdout.readline()  # written once the socket listens
        if ready != b"ready\n":
            raise RuntimeError(f"fork server exited {self.proc.wait()} before it was ready")
        atexit.register(self.close)

    def can_fork(self, env: dict[str, str]) -> bool:
        """Whether a server with environment `env` imports what this fork server imported."""
        return import_time(env) == import_time(self.env)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> AdoptedProcess:
        request = {"argv": argv, "env": env, "log": str(log_path), "cwd": os.getcwd()}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            replies = conn.makefile("rb")
            pid, adopted = replies.readline(), replies.readline()
        if adopted != b"adopted\n":
            raise RuntimeError("the fork server gave no process")
        return AdoptedProcess(int(pid))

    def close(self) -> None:
        atexit.unregister(self.close)
        self.proc.kill()
        self.proc.wait()
        self.path.unlink(missing_ok=True)
        self.path.parent.rmdir()


_fork_server: ForkServer | None = None
_starting = threading.Lock()  # tests may start servers from several threads


def fork_server(env: dict[str, str]) -> ForkServer:
    """This process's fork server for servers of environment `env`: started on first use, and
    again where a test has changed what the imports read since (an in-process test may set
    oneDNN's ISA cap for the rest of the process)."""
    global _fork_server
    with _starting:
        if _fork_server is not None and not _fork_server.can_fork(env):
            _fork_server.close()
            _fork_server = None
        if _fork_server is None:
            _fork_server = ForkServer(env)
    return _fork_server


# ---- the fork server's side ------------------------------------------------------------------
def run_server(entry, request: dict) -> None:
    """In the forked server: the environment, files and arguments a fresh
    `python -m kvpark.pod ARGV` would have had, then its `sys.exit(main())`."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(stdin, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(stdin)
    os.close(log)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` has it, not this file's folder
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [entry.__file__, *request["argv"]]
    sys.exit(entry.main(request["argv"]))


def serve(path: str) -> None:
    from kvpark.pod import __main__ as entry  # the seconds every server shares

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:  # end of file: the test process has exited
            return
        conn, _ = listener.accept()
        request = json.loads(conn.makefile("rb").readline())
        middle = os.fork()
        if middle == 0:  # exits at once, so the server is adopted by the test process
            listener.close()
            server = os.fork()
            if server == 0:
                conn.close()
                run_server(entry, request)
            conn.sendall(f"{server}\n".encode())
            os._exit(0)
        os.waitpid(middle, 0)  # it has exited: the server's parent is the test process now
        conn.sendall(b"adopted\n")
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
