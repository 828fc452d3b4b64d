"""Bounds checked before the work they bound: a body's arrays and objects are counted before it
is decoded, logit_bias text keys are tokenised only until the bound is passed, and a body is
decoded off the event loop."""

import asyncio
import json
import threading

import pytest

from kvpark.pod.http import request_body
from kvpark.pod.requests import json_body
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.fields import MAX_LOGIT_BIAS
from kvpark.pod.requests.sampling_fields import sampling_params


def test_containers_are_counted_outside_strings_only_past_the_bound():
    assert json_body.count_containers(b'{"a": [1, [2]], "b": "[[["}') == 6  # an upper bound
    many_in_text = json.dumps({"a": "[{" * 40_000, "b": [[1]]}).encode()
    assert json_body.count_containers(many_in_text) == 3
    escaped = json.dumps({"a": '\\"[' * 70_000}).encode()  # escapes do not end the string
    assert json_body.count_containers(escaped) == 1


def test_a_body_past_the_bound_is_refused_before_it_is_decoded(monkeypatch):
    decoded = []
    monkeypatch.setattr(json_body.json, "loads", lambda raw: decoded.append(raw))
    body = ("[" + ",".join(["[1]"] * json_body.MAX_CONTAINERS) + "]").encode()
    with pytest.raises(ApiError) as refused:
        json_body.decode_body(b'{"x": ' + body + b"}")
    assert refused.value.param == "body" and decoded == []


class CountingTokenizer:
    vocab_size = 1000
    eos_token_ids = frozenset()

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_bos):
        self.calls += 1
        return [7] * (len(text) // 4)  # four characters a token


def test_logit_bias_text_keys_are_tokenised_only_until_the_bound_is_passed():
    tokenizer = CountingTokenizer()
    keys = {f"word{i:04d}" * 100: 1 for i in range(1000)}  # 200 tokens each
    with pytest.raises(ApiError, match="more than"):
        sampling_params({"logit_bias": keys}, 100, ("max_tokens",), tokenizer)
    assert tokenizer.calls == MAX_LOGIT_BIAS // 200 + 1


def test_a_json_body_is_decoded_off_the_event_loop(monkeypatch):
    threads = []

    async def body(request, server):
        return b'{"a": 1}'

    def decode(raw):
        threads.append(threading.current_thread())
        return json.loads(raw)

    monkeypatch.setattr(request_body, "read_body", body)
    monkeypatch.setattr(request_body, "decode_body", decode)

    async def read():
        return await request_body.read_json(None, None), threading.current_thread()

    value, loop_thread = asyncio.run(read())
    assert value == {"a": 1} and threads and threads[0] is not loop_thread
