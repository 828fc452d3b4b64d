"""The step loop, in its own thread: schedule -> run -> hand the outputs to the scheduler.

The HTTP side talks to this facade only: `submit`, `cancel`, `hold_for_reader`,
`let_go_for_reader`, `park_slot`, `unpark_slot`, `save_slot`, `restore_slot`, `erase_slot`,
`abort_all`, `snapshot`. Everything that changes the pool, the scheduler or the model happens on
the engine thread, holding `lock` except while the model runs; other threads read scheduler
state only under `lock` (`snapshot`, `busy`, the metrics collector).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from ..memory.heap import HeapTrimmer
from ..memory.paging import pages_for
from ..memory.slot_files import SlotState
from ..sampling.sampler import ChunkOutput
from ..worker.runner import ModelRunner, StateLost
from . import reader_holds, step_failure
from .messages import FinishReason, SlotView, Submission
from .reporting import slot_view
from .scheduler import Scheduler
from .sequence import Phase, Sequence, make_sequence
from .slot_memory import SlotMemory
from .step_plan import ScheduledSeq

if TYPE_CHECKING:
    from ..model.tokenizer import Tokenizer

log = logging.getLogger("kvpark.engine")

IDLE_POLL_SECONDS = 0.05  # parked work waiting on nothing new is re-checked this often
T = TypeVar("T")


@dataclass(frozen=True)
class Capacity:
    """What the pool and the slots can hold (fixed at start)."""

    num_slots: int
    num_pages: int
    page_size: int
    shares_prompts: bool = False  # a prefix cache: `n > 1` siblings share the prompt's pages
    state_bytes: int = 0  # a hybrid model's state slot, one per slot (0: no state slots)

    @property
    def tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for_family(self, num_seqs: int, prompt: int, each: int) -> int:
        """Pages `num_seqs` siblings of up to `each` tokens need side by side: the prompt's
        full pages once when they are shared (all but its last token, which each computes)."""
        shared = (prompt - 1) // self.page_size if self.shares_prompts else 0
        return shared + num_seqs * (pages_for(each, self.page_size) - shared)


class EventOutlet(Protocol):
    """Where a step's KV events go (`serving/stack.py`'s publisher)."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


class EngineClosed(RuntimeError):
    """A submission after `abort_all`: the server is shutting down."""


class Engine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner,
                 on_step: Callable[[list[ScheduledSeq], float], None] = lambda plan, s: None,
                 lock: threading.RLock | None = None, memory: SlotMemory | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # the sequences' text and grammars (None: ids only)
        self.runner = runner
        self.on_step = on_step
        pool = scheduler.pool
        self.capacity = Capacity(scheduler.config.num_slots, pool.num_pages, pool.page_size,
                                 shares_prompts=pool.cache is not None,
                                 state_bytes=pool.state_bytes)
        self.lock = lock or threading.RLock()  # scheduler state; taken before _cond's lock
        self.memory = memory or SlotMemory(pool, scheduler.config.num_slots)  # slot files
        # the hand-over queues: submit and cancel never wait for a step to end
        self._cond = threading.Condition()
        self.heap = HeapTrimmer()
        self._incoming: list[Sequence] = []
        self._cancels: list[str] = []  # request ids
        self._calls: list[Callable[[], None]] = []
        self._stopping = False
        self._closed = False  # after abort_all: submissions are refused
        self._thread = threading.Thread(target=self._loop, name="kvpark-engine", daemon=True)
        self.kv_events: EventOutlet | None = None  # --kv-events-config

    # ---- called from other threads ------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Sequences waiting for a slot (submitted but not yet admitted). Read without the lock,
        so admission on the event loop never waits for a step: a count, not a snapshot."""
        return len(self._incoming) + len(self.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        with self.lock, self._cond:
            return len(self._incoming) + len(self.scheduler.waiting) + len(self.scheduler.active)

    @property
    def busy(self) -> bool:
        """Anything submitted and not finished (the drain waits on it): exact, under both locks,
        which the hand-over into the scheduler also holds."""
        with self.lock, self._cond:
            return self.num_unfinished > 0 or self._has_input()

    def snapshot(self) -> list[SlotView | None]:
        """Each slot's state, read in one piece."""
        with self.lock:
            return [None if seq is None else slot_view(seq) for seq in self.scheduler.slots]

    def start(self) -> None:
        if self.kv_events is not None:  # a subscriber hears at once that nothing is cached
            self.kv_events.flush()
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self.scheduler.wait_for_copies()  # no copy may outlive the buffers it writes
        if self.kv_events is not None:
            self.kv_events.close()

    def submit(self, submissions: list[Submission]) -> None:
        """Values in: the engine builds its own sequences, which no other thread holds.
        EngineClosed once `abort_all` ran: checked under the lock `abort_all` takes, so no
        submission can slip in behind it unaborted."""
        seqs = [make_sequence(s, self.tokenizer) for s in submissions]
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is shutting down")
            self._incoming.extend(seqs)
            self._cond.notify()

    def cancel(self, request_ids: Collection[str]) -> None:
        """End the sequences of these ids, wherever they are (finished ones stay as they are)."""
        with self._cond:
            self._cancels.extend(request_ids)
            self._cond.notify()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before the next step."""
        with self._cond:
            self._calls.append(fn)
            self._cond.notify()

    def abort_all(self, reason: FinishReason, error: str) -> None:
        """End every queued, running and parked sequence and refuse new ones (shutdown)."""
        with self._cond:
            self._closed = True
            self._calls.append(lambda: self.scheduler.abort_all(reason, error))
            self._cond.notify()

    def hold_for_reader(self, request_ids: Collection[str]) -> None:
        """Their client fell behind reading: park them until `let_go_for_reader`."""
        ids = frozenset(request_ids)
        self.call_soon(lambda: reader_holds.hold(self.scheduler, ids))

    def let_go_for_reader(self, request_ids: Collection[str]) -> None:
        ids = frozenset(request_ids)
        self.call_soon(lambda: reader_holds.let_go(self.scheduler, ids))

    def park_slot(self, slot_id: int) -> concurrent.futures.Future[str | None]:
        """POST /slots/{id}?action=park; the future holds why not, or None."""
        return self._on_slot(slot_id, self._park_slot)

    def unpark_slot(self, slot_id: int) -> concurrent.futures.Future[str | None]:
        return self._on_slot(slot_id, self._unpark_slot)

    def _on_slot(self, slot_id: int, action: Callable[[int, Sequence], str | None]
                 ) -> concurrent.futures.Future[str | None]:
        done: concurrent.futures.Future[str | None] = concurrent.futures.Future()

        def act() -> None:  # on the engine thread
            seq = self.scheduler.slots[slot_id]
            done.set_result(f"slot {slot_id} is idle" if seq is None else action(slot_id, seq))

        self.call_soon(act)
        return done

    def _park_slot(self, slot_id: int, seq: Sequence) -> str | None:
        if seq.phase is Phase.PARKED and seq.parking.manual:
            return f"slot {slot_id} is already parked"
        self.scheduler.park_manually(seq)
        return None

    def _unpark_slot(self, slot_id: int, seq: Sequence) -> str | None:
        if not seq.parking.manual:
            return f"slot {slot_id} was not parked by hand"
        self.scheduler.unpark(seq)
        return None

    def save_slot(self, slot_id: int) -> concurrent.futures.Future[SlotState | str]:
        """POST /slots/{id}?action=save: the slot's state with its pages copied out, or why
        not. The caller writes the file, off this thread."""
        return self._on_idle_slot(slot_id, lambda: self.memory.export(slot_id))

    def restore_slot(self, slot_id: int, state: SlotState
                     ) -> concurrent.futures.Future[str | None]:
        return self._on_idle_slot(slot_id, lambda: self.memory.restore(slot_id, state))

    def erase_slot(self, slot_id: int) -> concurrent.futures.Future[int | str]:
        """The tokens the slot remembered, or why not."""
        return self._on_idle_slot(slot_id, lambda: self.memory.erase(slot_id))

    def _on_idle_slot(self, slot_id: int, action: Callable[[], T]
                      ) -> concurrent.futures.Future[T | str]:
        """Run `action` on the engine thread if the slot runs nothing; else say it is busy (a
        running or parked sequence's pages are still changing). A failure goes to the future,
        not to the step loop, which would end every request."""
        done: concurrent.futures.Future[T | str] = concurrent.futures.Future()

        def act() -> None:
            if self.scheduler.slots[slot_id] is not None:
                done.set_result(f"slot {slot_id} is busy")
                return
            try:
                done.set_result(action())
            except Exception as exc:
                done.set_exception(exc)

        self.call_soon(act)
        return done

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            if not self.scheduler.has_work:  # going idle: freed heap memory back to the OS
                self.heap.on_idle()
            with self._cond:
                while not self._has_input() and not self.scheduler.has_work:
                    if self._stopping:
                        return
                    self._cond.wait()
                if self._stopping:
                    return
            with self.lock, self._cond:  # state first, then the queues (busy's order)
                calls = self._take_input()
            try:
                for fn in calls:
                    with self.lock:
                        fn()
                stepped = self.step()
            except Exception:  # a scheduler bug must not leave every client hanging
                log.exception("engine step failed; ending the requests it held")
                with self.lock:
                    self.scheduler.abort_all(FinishReason.ENGINE_ERROR,
                                             "internal error in the engine")
                stepped = True
            if self.kv_events is not None:  # what the step stored and removed, as values
                with self.lock:
                    self.kv_events.flush()
            if not stepped:
                with self._cond:
                    if not self._has_input():
                        self._cond.wait(IDLE_POLL_SECONDS)

    def _has_input(self) -> bool:
        return bool(self._incoming or self._cancels or self._calls)

    def _take_input(self) -> list[Callable[[], None]]:
        """Hand submissions and cancels to the scheduler (under the lock: a sequence is never
        in neither place, so `busy` cannot read False in between); return the calls."""
        incoming, self._incoming = self._incoming, []
        cancels, self._cancels = self._cancels, []
        calls, self._calls = self._calls, []
        for seq in incoming:
            self.scheduler.add(seq)
        if cancels:
            cancelled = set(cancels)
            for seq in [*self.scheduler.waiting, *self.scheduler.active]:
                if seq.request_id in cancelled:
                    self.scheduler.finish(seq, FinishReason.CANCELLED)
        return calls

    def step(self) -> bool:
        """One schedule -> run -> postprocess round; False when there was nothing to run.
        The model runs without the lock: it only reads the plan's pages."""
        with self.lock:
            plan = self.scheduler.schedule()
            if not plan and self.scheduler.wait_for_copies():  # only copies were in flight
                return True
        if not plan:
            return False
        started = time.perf_counter()
        try:
            sampled = self.runner.run(plan)
        except StateLost as exc:  # no rerun: it would feed the tokens twice
            log.exception("step of %d sequences of a hybrid model failed after writing state; "
                          "parking them by recompute", len(plan))
            with self.lock:
                step_failure.recover(self.scheduler, plan, f"internal error: {exc}")
            plan, sampled = [], []
        except Exception:  # one bad request must not take the others down with it
            log.exception("step of %d sequences failed; retrying them one by one", len(plan))
            plan, sampled = self._isolate_failure(plan)
        seconds = time.perf_counter() - started
        with self.lock:
            self.scheduler.update_from_output(plan, sampled, seconds)
            self.on_step(plan, seconds)
        return True

    def _isolate_failure(self, plan: list[ScheduledSeq]
                         ) -> tuple[list[ScheduledSeq], list[ChunkOutput]]:
        """Run each sequence of a failed step alone; end only those that fail again.

        Rerunning is safe: K/V a failed step wrote sit at the same pages and positions the
        rerun writes, and no sequence advanced.
        """
        survivors: list[ScheduledSeq] = []
        sampled: list[ChunkOutput] = []
        for item in plan:
            try:
                sampled.extend(self.runner.run([item]))
            except Exception as exc:
                log.exception("request %s failed", item.seq.request_id)
                with self.lock:
                    self.scheduler.finish(item.seq, FinishReason.ENGINE_ERROR,
                                          f"internal error: {exc}")
                continue
            survivors.append(item)
        return survivors, sampled
