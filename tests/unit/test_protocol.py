"""Request validation as pure functions: body decoding, quoting input, unsupported fields."""

import logging

import pytest

from kvpark.pod.requests import errors as request_errors
from kvpark.pod.requests.errors import ApiError, shown
from kvpark.pod.requests.json_body import decode_body
from kvpark.pod.requests.parsers import check_fields


@pytest.mark.parametrize("value", ["x" * 10_000, 7 ** 5000, [["y" * 500] * 50] * 50,
                                   {"k" * 300: "v" * 300}])
def test_shown_quotes_at_most_a_hundred_characters(value):
    text = shown(value)
    assert len(text) <= request_errors.MAX_SHOWN and text


def test_a_valid_surrogate_pair_passes_and_a_lone_one_is_located():
    assert decode_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}
    with pytest.raises(ApiError) as exc:
        decode_body(b'{"messages": [{"content": "ok"}, {"content": ["x", "\\udc00"]}]}')
    assert exc.value.param == "messages[1].content[1]"
    with pytest.raises(ApiError) as exc:  # a bad key: named by the object that holds it
        decode_body(b'{"metadata": {"\\ud800": 1}}')
    assert exc.value.param == "metadata"


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b'{"n": ' + b"1" * 5000 + b"}",
                                 b"", b"[]", b"\xff"])
def test_bodies_that_are_not_a_json_object_name_the_body(raw):
    with pytest.raises(ApiError) as exc:
        decode_body(raw)
    assert exc.value.status == 400 and exc.value.param == "body"


@pytest.mark.parametrize("body", [{"presence_penalty": 0.0}, {"logprobs": False},
                                  {"tools": None}, {"logit_bias": {}}, {"best_of": 1}])
def test_values_that_ask_for_nothing_pass(body):
    check_fields(body, "completion")


@pytest.mark.parametrize("body,param", [({"best_of": True}, "best_of"),
                                        ({"suffix": 0}, "suffix")])
def test_look_alikes_of_those_values_are_refused(body, param):
    with pytest.raises(ApiError, match="not supported") as exc:
        check_fields(body, "completion")
    assert exc.value.param == param


def test_unknown_fields_are_logged_once_per_name(caplog):
    with caplog.at_level(logging.WARNING, logger="kvpark.protocol"):
        for _ in range(3):
            check_fields({"prompt": "x", "unit_test_field_a": 1, "unit_test_field_b": 2},
                         "completion")
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["The following fields were present in the request but ignored: "
                      "{'unit_test_field_a', 'unit_test_field_b'}"]
