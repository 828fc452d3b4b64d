"""The step loop, in its own thread: schedule -> run -> postprocess, and nothing else.

The HTTP side submits and cancels sequences through thread-safe calls; everything that touches
the pool, the scheduler or the model happens on this thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .runner import ModelRunner
from .scheduler import ScheduledSeq, Scheduler
from .slot import Sequence

log = logging.getLogger("kvpark.engine")

IDLE_POLL_SECONDS = 0.05  # parked work waiting on nothing new is re-checked this often


class Engine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, eos_token_ids: frozenset[int],
                 on_step: Callable[[list[ScheduledSeq], float], None] = lambda plan, s: None
                 ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.on_step = on_step
        self._cond = threading.Condition()
        self._incoming: list[Sequence] = []
        self._cancels: list[Sequence] = []
        self._calls: list[Callable[[], None]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvpark-engine", daemon=True)

    # ---- called from other threads ------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Sequences waiting for a slot (submitted but not yet admitted)."""
        return len(self._incoming) + len(self.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        return self.num_queued + len(self.scheduler.active)

    @property
    def busy(self) -> bool:
        return self.num_unfinished > 0 or self._has_input()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self.scheduler.wait_for_copies()  # no copy may outlive the buffers it writes

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cond:
            self._incoming.extend(seqs)
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        with self._cond:
            self._cancels.append(seq)
            self._cond.notify()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before the next step (for /slots actions)."""
        with self._cond:
            self._calls.append(fn)
            self._cond.notify()

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._has_input() and not self.scheduler.has_work:
                    if self._stopping:
                        return
                    self._cond.wait()
                if self._stopping:
                    return
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
                calls, self._calls = self._calls, []
            for seq in incoming:
                self.scheduler.add(seq)
            for seq in cancels:
                self.scheduler.finish(seq, reason="cancelled")
            try:
                for fn in calls:
                    fn()
                stepped = self.step()
            except Exception:  # a scheduler bug must not leave every client hanging
                log.exception("engine step failed; ending the requests it held")
                self.scheduler.abort_all("internal error in the engine", status=500)
                stepped = True
            if not stepped:
                with self._cond:
                    if not self._has_input():
                        self._cond.wait(IDLE_POLL_SECONDS)

    def _has_input(self) -> bool:
        return bool(self._incoming or self._cancels or self._calls)

    def step(self) -> bool:
        """One schedule -> run -> postprocess round; False when there was nothing to run."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.swapper.num_in_flight:  # only copies in flight: wait for them
                self.scheduler.wait_for_copies()
                return True
            return False
        started = time.perf_counter()
        try:
            sampled = self.runner.run(plan)
        except Exception:  # one bad request must not take the others down with it
            log.exception("step of %d sequences failed; retrying them one by one", len(plan))
            plan, sampled = self._isolate_failure(plan)
        seconds = time.perf_counter() - started
        for item, token in zip(plan, sampled):
            self._postprocess(item, token, seconds)
        self.on_step(plan, seconds)
        return True

    def _isolate_failure(self, plan: list[ScheduledSeq]
                         ) -> tuple[list[ScheduledSeq], list[int | None]]:
        """Run each sequence of a failed step alone; end only those that fail again.

        Rerunning is safe: K/V a failed step wrote sit at the same pages and positions the
        rerun writes, and no sequence advanced.
        """
        survivors: list[ScheduledSeq] = []
        sampled: list[int | None] = []
        for item in plan:
            try:
                sampled.extend(self.runner.run([item]))
            except Exception as exc:
                log.exception("request %s failed", item.seq.request_id)
                self.scheduler.finish(item.seq, error=f"internal error: {exc}")
                continue
            survivors.append(item)
        return survivors, sampled

    def _postprocess(self, item: ScheduledSeq, token: int | None, seconds: float) -> None:
        seq = item.seq
        if seq.is_finished:
            return
        if seq.in_prompt:
            seq.prompt_seconds += seconds
        self.scheduler.advance(item, token)
        if token is None:
            return
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            self.scheduler.finish(seq, reason="stop")
            return
        if seq.on_event(seq, "token", token):
            self.scheduler.finish(seq, reason="stop")
        elif seq.params.max_tokens is not None and seq.num_generated >= seq.params.max_tokens:
            self.scheduler.finish(seq, reason="length")
        elif len(seq.tokens) >= self.scheduler.config.max_context:
            self.scheduler.finish(seq, reason="length")
