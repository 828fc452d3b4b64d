"""Prompts first (`--prefill-first`): while more prompt tokens wait than a step takes, decode
rows sit steps out until they have waited the limit, and never longer; with less prompt work
waiting, or a limit of 0, every running sequence steps; every sequence still finishes."""

import itertools

import pytest
import torch
from test_scheduler_properties import FakeRunner, make_seq

from kvpark.pod.args import parse_args
from kvpark.pod.core.engine import Engine
from kvpark.pod.core.scheduler import Scheduler, SchedulerConfig
from kvpark.pod.core.step_plan import hold_decode_rows
from kvpark.pod.core.swap import Swapper
from kvpark.pod.memory.host_store import HostStore
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.serving.choices import pick_prefill_first

BATCH = 8
STEP_SECONDS = 0.1  # the fake clock's tick: one schedule, one tick


def decoding(last_step_at: float, finished: dict):
    seq = make_seq(4, 100, finished)
    seq.num_computed = len(seq.tokens) - 1  # one token to feed: a decode row
    seq.last_step_at = last_step_at
    return seq


def prompt(tokens: int, finished: dict):
    return make_seq(tokens, 4, finished)


def test_recent_decode_rows_sit_out_while_a_step_of_prompt_waits():
    finished: dict = {}
    fresh, recent = decoding(9.5, finished), decoding(9.2, finished)
    waiting = prompt(BATCH, finished)
    kept, held = hold_decode_rows([fresh, recent, waiting], BATCH, now=10.0, wait=1.0)
    assert kept == [waiting] and held == 2


def test_once_one_decode_row_has_waited_the_limit_every_decode_row_steps_alone():
    """The decode rows' pass over their weights is paid once for all of them, not once for each
    row as it comes due, and in a decode step (the prompt sits that one out)."""
    finished: dict = {}
    fresh, stale = decoding(9.5, finished), decoding(8.9, finished)
    waiting = prompt(BATCH, finished)
    kept, held = hold_decode_rows([fresh, stale, waiting], BATCH, now=10.0, wait=1.0)
    assert kept == [fresh, stale] and held == 0


def test_everyone_steps_under_a_step_of_prompt_or_with_no_limit():
    finished: dict = {}
    fresh = decoding(9.9, finished)
    short = prompt(BATCH - 1, finished)
    assert hold_decode_rows([fresh, short], BATCH, now=10.0, wait=1.0) == ([fresh, short], 0)
    long = prompt(5 * BATCH, finished)
    assert hold_decode_rows([fresh, long], BATCH, now=10.0, wait=0.0) == ([fresh, long], 0)


def test_a_sequence_that_never_stepped_is_not_held():
    """A full prefix-cache hit leaves one prompt token: a decode-like row with no last step."""
    finished: dict = {}
    cached = decoding(0.0, finished)
    kept, held = hold_decode_rows([cached, prompt(4 * BATCH, finished)], BATCH, 5.0, 1.0)
    assert kept == [cached] and held == 0


def make_engine(wait: float) -> Engine:
    pool = KVPool(num_layers=1, num_pages=64, page_size=4, num_kv_heads=1, head_dim=2)
    config = SchedulerConfig(num_slots=3, batch_size=BATCH, prefill_first=wait)
    scheduler = Scheduler(config, pool, Swapper(pool, HostStore(-1)))
    scheduler.candidates.clock = map(lambda i: i * STEP_SECONDS, itertools.count()).__next__
    return Engine(scheduler, FakeRunner())


def steps_of(engine: Engine, seq) -> list[int]:
    """Run to the end; the schedules that gave `seq` a row (0: the next; -1: the last one)."""
    fed, step = [-1], 0
    while engine.scheduler.has_work:
        before = seq.num_computed
        engine.step()
        if seq.num_computed > before:
            fed.append(step)
        step += 1
    return fed


@pytest.mark.parametrize("wait", [0.0, 0.35, 1.0])
def test_a_stream_stalls_at_most_the_limit_and_everything_finishes(wait):
    """One stream decoding when a 96-token prompt (12 steps) arrives: with a limit its decode
    rows come every ceil(limit / tick) steps while the prompt has a step of tokens left, and in
    every step without one; all tokens are made."""
    engine, finished = make_engine(wait), {}
    stream = make_seq(4, 40, finished)
    engine.scheduler.add(stream)
    for _ in range(3):
        engine.step()
    engine.scheduler.add(prompt(96, finished))
    fed = steps_of(engine, stream)
    gaps = [b - a for a, b in zip(fed, fed[1:])]
    longest = round(wait / STEP_SECONDS + 0.4999) if wait else 1
    assert max(gaps) == longest
    assert gaps[-1] == 1  # once the prompt is in, every step again
    assert stream.num_generated == 40 and len(finished) == 2
    held = engine.scheduler.candidates.held
    assert (held > 0) == (wait > 0)


class PlanRecorder(FakeRunner):
    """FakeRunner that keeps each step's sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[list] = []

    def run(self, plan):
        self.plans.append([item.seq for item in plan])
        return super().run(plan)


def test_streams_that_began_decoding_at_different_times_step_together_during_a_burst():
    """A stream decoding when a 200-token prompt (25 steps) arrives, a second stream's short
    prompt two steps later: each step that gives one of them a row while the long prompt has a
    step of tokens left gives both a row and the long prompt none, and neither waits past the
    limit."""
    engine, finished = make_engine(0.35), {}
    recorder = engine.runner = PlanRecorder()
    first, second = make_seq(4, 60, finished), make_seq(4, 60, finished)
    engine.scheduler.add(first)
    for _ in range(2):
        engine.step()
    burst = prompt(200, finished)
    engine.scheduler.add(burst)
    start = len(recorder.plans)
    for _ in range(2):
        engine.step()
    engine.scheduler.add(second)
    while second.num_computed < len(second.tokens) - 1:  # its prompt in
        engine.step()
    joined = len(recorder.plans)
    while burst.num_pending > BATCH:
        engine.step()
    during = recorder.plans[joined:]
    with_decode = [plan for plan in during if first in plan or second in plan]
    assert with_decode and all(plan == [first, second] for plan in with_decode)
    assert len(with_decode) < len(during) / 2
    for stream in (first, second):  # no stream sits out more than ceil(0.35 s / tick) steps
        fed = [step for step, plan in enumerate(recorder.plans[start:]) if stream in plan]
        assert max(b - a for a, b in zip(fed, fed[1:])) <= 4


def test_auto_is_a_second_on_the_cpu_and_off_on_cuda():
    args = parse_args([])
    assert pick_prefill_first(args, torch.device("cpu")) == 1.0
    assert pick_prefill_first(args, torch.device("cuda")) == 0.0
    assert pick_prefill_first(parse_args(["--prefill-first", "0.25"]),
                              torch.device("cuda")) == 0.25


@pytest.mark.parametrize("value", ["-1", "inf", "soon"])
def test_a_bad_limit_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--prefill-first", value])
    assert exit_info.value.code == 2
    assert "--prefill-first" in capsys.readouterr().err
