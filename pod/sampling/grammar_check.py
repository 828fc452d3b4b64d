"""Compiling a grammar so that no grammar can take the server down.

llguidance compiles a grammar recursively in native code: a chain of a few thousand rules (or of
`$ref`s, or nested object definitions) overflows the thread's stack, and the process dies with
SIGSEGV, which no Python code can catch; a grammar may also run away with time or memory. So each
grammar the server has not compiled before is first compiled by a child process
(`GrammarChecker`), under limits:

- stack: the child compiles on a thread of `CHECK_STACK_BYTES`, the server on one of
  `COMPILE_STACK_BYTES` (4x), so whatever the child survived the server survives with room to
  spare (the depth a compile reaches depends only on the grammar). Masks and token steps after
  the compile are not recursive in the grammar's depth (a 20,000-rule chain masks on a 64 KiB
  stack), so the engine thread needs no more than its default;
- time: `CHECK_TIMEOUT_SECONDS`, then the child is killed;
- memory: the child's address space may grow `CHECK_MEMORY_BYTES` past what it held once ready.

A grammar the child could not compile is the client's 400 (`GrammarError`); a dead or killed
child is started again for the next grammar. The child imports only llguidance (no torch): it is
ready in well under a second, and started on the first grammar.

Wire format on the child's stdin and stdout: messages of a little-endian u32 length and that
many bytes of JSON. First the tokenizer (`{"tokenizer", "n_vocab", "eos"}`, answered
`{"ready": true}`), then one `{"grammar": text, "source": kind}` per check, answered
`{"error": ""}` (it compiles) or `{"error": "why not"}`.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import llguidance

log = logging.getLogger("kvpark.grammar")

CHECK_STACK_BYTES = 8 << 20
COMPILE_STACK_BYTES = 4 * CHECK_STACK_BYTES
CHECK_TIMEOUT_SECONDS = 10.0  # a large legitimate schema compiles in well under a second
CHECK_MEMORY_BYTES = 2 << 30
START_TIMEOUT_SECONDS = 60.0  # the child's imports and tokenizer view, on a loaded machine
# llguidance's own bounds, stated rather than inherited: symbols in the grammar, lexer states
# (about 1-2 kB each), regex fuel at build and per mask, Earley items per mask.
PARSER_LIMITS = dict(max_grammar_size=500_000, max_lexer_states=250_000,
                     initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_items_in_row=2000)

# what a grammar that no output can match is told, by source
NOTHING_MATCHES = {
    "json_schema": "Unsatisfiable schema: no JSON value can even begin (a $ref that only "
                   "leads back to itself?)",
    "gbnf": "no text can match it: no first token fits (rules that only lead back to "
            "themselves?)",
    "regex": "no text can match this regex: no first token fits (an empty character class?)",
    "choice": "no text can match any of the choices: no first token fits",
}
_HEADER = struct.Struct("<I")
T = TypeVar("T")


class GrammarError(ValueError):
    """The grammar or schema does not compile; the message says where."""


class GrammarCheckUnavailable(RuntimeError):
    """The checking child could not be started: no grammar can be accepted now."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS, verbose_errors=False)


def compile_matcher(lltok: llguidance.LLTokenizer, text: str,
                    source: str) -> llguidance.LLMatcher:
    """The compiled grammar (a matcher at its start), or GrammarError. Both the child and the
    server compile through here, each on its own stack (`run_with_stack`)."""
    limits = parser_limits()
    problem = llguidance.LLMatcher.validate_grammar(text, lltok, limits=limits)
    if problem:
        raise GrammarError(problem.strip().splitlines()[0][:300])
    matcher = llguidance.LLMatcher(lltok, text, log_level=0, limits=limits)
    if matcher.is_error():
        raise GrammarError(matcher.get_error().strip().splitlines()[0][:300])
    if not can_start(matcher):
        raise GrammarError(NOTHING_MATCHES.get(source, NOTHING_MATCHES["gbnf"]))
    return matcher


def can_start(matcher: llguidance.LLMatcher) -> bool:
    """Whether some output can begin: a token fits, or the empty output is complete. llguidance
    compiles a grammar whose rules only lead back to themselves (`{"$ref": "#"}`, a `$defs`
    cycle) without complaint, and only its first mask finds that nothing fits; a sequence would
    then end at once with EOS and an empty "answer" that is not JSON. Probed on a copy: the
    cached matcher must stay at its start."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    return not probe.is_error()


_stack_lock = threading.Lock()


def run_with_stack(fn: Callable[[], T], stack_bytes: int) -> T:
    """`fn()` on a new thread whose stack is `stack_bytes`; its result, or its exception."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    # threading.stack_size is process-wide: held only while this thread is made (a thread
    # another module starts meanwhile gets the larger stack, which harms nothing)
    with _stack_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name="kvpark-grammar", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# ---- the server's side --------------------------------------------------------------------

@dataclass(frozen=True)
class TokenizerView:
    """What the child needs to build llguidance's view of the tokenizer."""

    json_text: str  # the Hugging Face tokenizer.json
    n_vocab: int
    eos: tuple[int, ...]

    def build(self) -> llguidance.LLTokenizer:
        return llguidance.LLTokenizer(self.json_text, n_vocab=self.n_vocab,
                                      eos_token=list(self.eos))


class GrammarChecker:
    """One child process that compiles grammars first; checks are serialised (one child)."""

    def __init__(self, view: TokenizerView, timeout: float = CHECK_TIMEOUT_SECONDS) -> None:
        self.view = view
        self.timeout = timeout
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def check(self, text: str, source: str) -> None:
        """Returns when the grammar compiles in the child; GrammarError says why it does not
        (its own error, or that compiling it crashed or ran too long)."""
        with self._lock:
            child = self._ready_child()
            try:
                _send(child.stdin, {"grammar": text, "source": source})
                reply = _receive(child.stdout, self.timeout)
            except TimeoutError:
                self._kill(f"a grammar ran past {self.timeout:g} s")
                raise GrammarError(f"compiling it took longer than {self.timeout:g} s") from None
            except (OSError, EOFError):
                raise GrammarError(self._died()) from None
        if reply.get("error"):
            raise GrammarError(str(reply["error"]))

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._kill("the server is stopping")

    def _ready_child(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        started = time.perf_counter()
        try:
            child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        except OSError as exc:
            raise GrammarCheckUnavailable(f"the grammar checker did not start: {exc}") from None
        try:
            _send(child.stdin, {"tokenizer": self.view.json_text, "n_vocab": self.view.n_vocab,
                                "eos": list(self.view.eos)})
            _receive(child.stdout, START_TIMEOUT_SECONDS)
        except (OSError, EOFError, TimeoutError) as exc:
            child.kill()
            child.wait()
            raise GrammarCheckUnavailable("the grammar checker did not start "
                                          f"({type(exc).__name__})") from None
        log.info("grammar checker: child process %d ready in %.2f s", child.pid,
                 time.perf_counter() - started)
        self._child = child
        return child

    def _died(self) -> str:
        child, self._child = self._child, None
        assert child is not None
        code = child.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log.warning("grammar checker: child process %d died compiling a grammar (%s); a new "
                    "one starts with the next grammar", child.pid, how)
        return (f"the grammar engine crashed compiling it ({how}): rules, $refs or nested "
                "definitions chained too deeply, or too large")

    def _kill(self, why: str) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.kill()
        child.wait()
        log.warning("grammar checker: child process %d killed: %s", child.pid, why)


def _send(stream: IO[bytes] | None, message: dict[str, Any]) -> None:
    assert stream is not None
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes] | None, timeout: float) -> dict[str, Any]:
    """One message, TimeoutError after `timeout` seconds, EOFError when the other side died."""
    assert stream is not None
    deadline = time.monotonic() + timeout
    header = _read_exactly(stream, _HEADER.size, deadline)
    return json.loads(_read_exactly(stream, _HEADER.unpack(header)[0], deadline))


def _read_exactly(stream: IO[bytes], size: int, deadline: float) -> bytes:
    fd, data = stream.fileno(), b""
    while len(data) < size:
        left = deadline - time.monotonic()
        wait = None if left == float("inf") else max(left, 0.0)
        if not select.select([fd], [], [], wait)[0]:
            raise TimeoutError
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


# ---- the child's side ---------------------------------------------------------------------

def _check_one(lltok: llguidance.LLTokenizer, text: str, source: str) -> str:
    try:
        run_with_stack(lambda: compile_matcher(lltok, text, source), CHECK_STACK_BYTES)
    except GrammarError as exc:
        return str(exc)
    return ""


def _limit_memory() -> None:
    with open("/proc/self/statm") as statm:  # pages of address space now
        held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = held + CHECK_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def child_main() -> None:
    # the protocol owns stdout: anything else printed goes to stderr (the server's log)
    stdin = os.fdopen(os.dup(0), "rb", buffering=0)
    stdout = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    first = _receive(stdin, START_TIMEOUT_SECONDS)
    lltok = TokenizerView(first["tokenizer"], first["n_vocab"], tuple(first["eos"])).build()
    if sys.platform == "linux":
        _limit_memory()
    _send(stdout, {"ready": True})
    while True:
        try:
            message = _receive(stdin, float("inf"))
        except EOFError:  # the server went away
            return
        _send(stdout, {"error": _check_one(lltok, message["grammar"], message["source"])})


if __name__ == "__main__":
    child_main()
