"""The thread boundary (issue 26): the event loop and the engine thread exchange values only. A
request goes in as frozen `Submission`s, and every event comes out as a frozen value; nothing the
event loop holds for a request (its stream, its wire format) reaches a sequence or any other
state the engine thread writes, at any moment of a request that parks, resumes, streams logprobs
and echoes, over the real engine thread and the synthetic model."""

import asyncio
import dataclasses
import enum
import gc
import json
import types

import pytest
import torch

from kvpark.pod.args import parse_args
from kvpark.pod.core.engine import Engine
from kvpark.pod.core.messages import Event, StreamEvent, Submission
from kvpark.pod.core.scheduler import Scheduler
from kvpark.pod.core.sequence import ParkState, Sequence, SpecState, make_sequence
from kvpark.pod.core.text_output import TextOutput
from kvpark.pod.http.formats import get_format
from kvpark.pod.http.sse import stream_events
from kvpark.pod.http.stream import EventSink, open_stream
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.model.tokenizer import Tokenizer
from kvpark.pod.requests import parsers as protocol
from kvpark.pod.requests.input_limits import InputLimits
from kvpark.pod.sampling.sampler import SamplingParams
from kvpark.pod.serving.stack import build_stack

# what only the engine thread may write
ENGINE_OWNED = (Sequence, ParkState, SpecState, TextOutput, Engine, Scheduler, KVPool,
                torch.Generator, torch.Tensor)
# shared, read-only infrastructure and code: not request state, and not walked
NOT_WALKED = (types.ModuleType, type, types.FunctionType, types.CodeType, types.FrameType,
              types.CoroutineType, asyncio.AbstractEventLoop, asyncio.Future, Tokenizer)


def engine_state_reached_from(root: object) -> list[str]:
    """Everything engine-owned that `root` reaches through references."""
    seen: set[int] = set()
    todo, found = [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, NOT_WALKED):
            continue
        seen.add(id(obj))
        if isinstance(obj, ENGINE_OWNED):
            found.append(type(obj).__name__)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def mutable_parts(value: object) -> list[str]:
    """What in a value could change after it was made (empty: a value)."""
    if value is None or isinstance(value, (str, int, float, bool, enum.Enum)):
        return []
    if isinstance(value, (tuple, frozenset)):
        return [part for item in value for part in mutable_parts(item)]
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        return [part for f in dataclasses.fields(value)
                for part in mutable_parts(getattr(value, f.name))]
    return [type(value).__name__]


@pytest.fixture(scope="module")
def stack():
    args = parse_args(["-m", "synthetic:tiny", "-np", "2", "-c", "1024", "--preempt-every", "3"],
                      env={})
    stack = build_stack(args)
    stack.engine.start()
    yield stack
    stack.engine.stop()


def submit(stack, body: dict):
    raw = json.dumps(body).encode()
    gens = protocol.parse_requests("completion", raw, stack.tokenizer,
                                   InputLimits.of(stack.max_context, 16), stack.defaults)
    stream, submissions = open_stream(asyncio.get_running_loop(), stack.tokenizer, gens, "cmpl-t")
    for submission in submissions:  # in: values, and the stream's channel for the events out
        sink = submission.sink
        assert mutable_parts(dataclasses.replace(submission, sink=None)) == []
        assert isinstance(sink, EventSink)
    stack.engine.submit(submissions)
    del submissions, sink
    return stream


BODY = {"prompt": ["The quick brown fox", "jumps over"], "n": 2, "max_tokens": 12,
        "ignore_eos": True, "logprobs": 2, "echo": True, "temperature": 0.7, "seed": 5}


def checked(events):
    """The stream's events, each checked to be a value as it arrives."""
    async def each(keepalive=None):
        async for event in events(keepalive):
            assert isinstance(event, Event) and mutable_parts(event) == []
            yield event
    return each


def test_a_streamed_request_reaches_no_engine_state(stack):
    async def run() -> list[str]:
        stream = submit(stack, {**BODY, "stream": True})
        stream.events = checked(stream.events)
        lines = []
        async for line in stream_events(stream, stack.engine, get_format("m", stream, "fp"),
                                        keepalive=0):
            lines.append(line)
            assert engine_state_reached_from(stream) == []
        assert [c.result.index for c in stream.choices] == [0, 1, 2, 3]
        return lines

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert sum(c["choices"][0]["finish_reason"] == "length" for c in chunks) == 4


def test_a_whole_response_reaches_no_engine_state(stack):
    async def run() -> dict:
        stream = submit(stack, {**BODY, "n": 1, "prompt": [*BODY["prompt"], "over the dog"]})
        seen: set[StreamEvent] = set()
        async for event in stream.events():
            seen.add(event.kind)
            assert mutable_parts(event) == []
            assert engine_state_reached_from(stream) == []
        fmt = get_format("m", stream, "fp")
        body = fmt.body()
        assert engine_state_reached_from(fmt) == []
        # --preempt-every parks sequences outside a family (n = 1)
        assert StreamEvent.PARKED in seen and StreamEvent.RESUMED in seen
        return body

    body = asyncio.run(run())
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 36 and body["preempt"]["parks"] > 0


def test_the_walk_finds_a_sequence_a_stream_would_hold(stack):
    """The check itself: a stream that kept a sequence (as streams once did) is caught."""
    async def run() -> list[str]:
        stream = submit(stack, {**BODY, "n": 1, "prompt": "x"})
        await stream.wait_finished()
        stream.echoes[0] = make_sequence(Submission("x", (1,), SamplingParams(), None,
                                                    lambda *a: None), None)
        return engine_state_reached_from(stream)

    assert asyncio.run(run()) == ["Sequence"]
