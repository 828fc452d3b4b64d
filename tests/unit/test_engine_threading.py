"""The engine's facade seen from other threads: `busy` never reads False while a submitted
sequence is on its way into the scheduler (the SIGTERM drain relies on it), and `snapshot`
reads the slots in one piece."""

import threading
import time

from kvpark.pod.core.engine import Engine, EngineClosed
from kvpark.pod.core.messages import FinishReason, Submission
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.sequence import Sequence, make_sequence
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.sampling.sampler import ChunkOutput, Sampled, SamplingParams


class HeldScheduler(Scheduler):
    """`add` waits until the test lets it go: the moment a submission is in neither the
    engine's queue nor the scheduler's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.adding = threading.Event()
        self.release = threading.Event()

    def add(self, seq: Sequence) -> None:
        self.adding.set()
        assert self.release.wait(30), "the test never released add()"
        super().add(seq)


class GatedRunner:
    """Samples token 7 once the test lets the step go (the model runs without the lock)."""

    def __init__(self) -> None:
        self.proceed = threading.Event()

    def run(self, plan):
        assert self.proceed.wait(30), "the test never let the step go"
        return [ChunkOutput(Sampled(7) if item.samples else None) for item in plan]


def make_engine(scheduler_class=Scheduler) -> Engine:
    pool = KVPool(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=2)
    scheduler = scheduler_class(SchedulerConfig(num_slots=2), pool, Swapper(pool, HostStore(-1)),
                                frozenset({3}))
    return Engine(scheduler, GatedRunner())


def make_submission(finished: threading.Event) -> Submission:
    def sink(event):
        if event.kind == "finished":
            finished.set()

    return Submission("r", (1, 2, 4), SamplingParams(temperature=0, max_tokens=2), None, sink)


def test_busy_holds_while_a_submission_moves_into_the_scheduler():
    engine = make_engine(HeldScheduler)
    finished = threading.Event()
    engine.start()
    try:
        engine.submit([make_submission(finished)])
        assert engine.scheduler.adding.wait(30)
        seen: list[bool] = []
        reader = threading.Thread(target=lambda: seen.append(engine.busy))
        reader.start()
        # before the fix `busy` answered at once, False: the queue was already empty and the
        # scheduler did not have the sequence yet; now it waits for the hand-over to finish
        reader.join(timeout=1.0)
        engine.scheduler.release.set()
        reader.join(timeout=30)  # the step waits for the runner's gate: the sequence is held
        assert seen == [True]
        engine.runner.proceed.set()
        assert finished.wait(30)
    finally:
        engine.scheduler.release.set()
        engine.runner.proceed.set()
        engine.stop()
    assert not engine.busy


def test_snapshot_shows_each_slot():
    engine = make_engine()
    assert engine.snapshot() == [None, None]
    finished = threading.Event()
    seq = make_sequence(make_submission(finished), None)
    engine.scheduler.add(seq)
    engine.scheduler.schedule()
    view = engine.snapshot()[seq.slot_id]
    assert view.request_id == "r" and view.num_prompt == 3 and view.phase == "prompt"
    assert engine.capacity.tokens == 32 and engine.capacity.num_slots == 2


def test_no_submission_escapes_an_abort_that_interleaves_with_it():
    """The drain's abort and a request's submit from another thread, racing: every submission
    is refused (EngineClosed) or ends with the abort's reason; none runs on behind it. The
    steps are held until the abort, so nothing finishes on its own before it."""
    engine = make_engine()
    engine.start()
    reasons: list[FinishReason] = []
    refused = threading.Event()
    submitted = threading.Event()

    def sink(event):
        if event.kind == "finished":
            reasons.append(event.result.finish_reason)

    def submit_until_refused() -> None:
        count = 0
        while count < 100_000:  # bounded: without the fix submits are never refused
            try:
                engine.submit([Submission(f"r{count}", (1, 2, 4),
                                          SamplingParams(temperature=0, max_tokens=2), None,
                                          sink)])
            except EngineClosed:
                refused.set()
                return
            count += 1
            submitted.set()

    submitter = threading.Thread(target=submit_until_refused)
    submitter.start()
    assert submitted.wait(30)
    engine.abort_all(FinishReason.SHUTDOWN, "shutting down")
    submitter.join(60)
    engine.runner.proceed.set()
    deadline = time.monotonic() + 60
    while engine.busy and time.monotonic() < deadline:  # polling the state, bounded
        time.sleep(0.005)
    engine.stop()
    assert refused.is_set()
    assert reasons and set(reasons) == {FinishReason.SHUTDOWN}
    assert engine.num_unfinished == 0
