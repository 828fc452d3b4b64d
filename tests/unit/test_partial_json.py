"""Constrained output that max_tokens cut short: read as far as it goes
(pod/requests/partial_json.py), and a tool call cut short answered as OpenAI answers it
(pod/requests/tools.py `parse_cut_short`)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpark.pod.requests import partial_json, tools

CALL = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": [1, 2]}}, {"name": "get_time", "arguments": {"city": "Rome"}}]}')


def test_a_whole_text_is_one_complete_tree():
    root = partial_json.parse_prefix(CALL)
    assert root.complete and root.value(CALL) == json.loads(CALL)
    first = root.members["tool_calls"].items[0]
    assert first.members["name"].text == "get_weather"


def test_every_prefix_parses_and_whole_values_stay_whole():
    for end in range(1, len(CALL)):
        root = partial_json.parse_prefix(CALL[:end])
        assert root is None or not root.complete or end == len(CALL)
        for node in root.members.get("tool_calls", partial_json.Node("array", 0)).items:
            if node.complete:
                assert node.value(CALL[:end]) in json.loads(CALL)["tool_calls"]


@pytest.mark.parametrize("text,so_far", [
    ('{"a": "caf\\u00e', "caf"), ('{"a": "x\\', "x"), ('{"a": "x\\\\', "x\\"),
    ('{"a": "x\\ud83d', "x"), ('{"a": "x\\ud83d\\ude00', "x\U0001F600"), ('{"a": "tab\\t', "tab\t"),
])
def test_a_string_cut_inside_an_escape_keeps_what_is_whole(text, so_far):
    node = partial_json.parse_prefix(text).members["a"]
    assert not node.complete and node.text == so_far
    node.text.encode("utf-8")  # never half a surrogate pair


@pytest.mark.parametrize("text", ["plain words", "}", '{"a" 1}', '{"a": 1} trailing', "[1 2]"])
def test_text_that_is_not_a_json_prefix_is_refused(text):
    with pytest.raises(ValueError):
        partial_json.parse_prefix(text)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8),
       st.sampled_from([None, 2]), st.data())
def test_any_prefix_of_any_json_parses(value, indent, data):
    text = json.dumps(value, indent=indent, ensure_ascii=data.draw(st.booleans()))
    end = data.draw(st.integers(0, len(text)))
    root = partial_json.parse_prefix(text[:end])
    if end == len(text) and root.kind != "scalar":  # `12` or `null` at the end may go on
        assert root.complete and root.value(text) == value
    if end < len(text) and root is not None and root.kind != "scalar":
        assert not root.complete


def test_a_call_cut_inside_its_arguments_keeps_them_as_far_as_they_got():
    out = tools.parse_output('{"tool_calls": [{"name": "get_weather", "arguments": '
                             '{"city": "Paris", "id": "call_1')
    assert out.content is None
    assert [c["function"] for c in out.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "id": "call_1'}]


def test_whole_calls_before_the_cut_stay_whole_and_a_cut_name_is_left_out():
    text = CALL[:CALL.index('"get_time"') + 5]
    out = tools.parse_output(text)
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"]
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {
        "city": "Paris", "days": [1, 2]}


@pytest.mark.parametrize("text,content", [
    ('{"response": "Hello wor', "Hello wor"), ('{"response": {"a": [1', '{"a": [1'),
    ('{"resp', ""), ('{"tool_calls": [{"na', ""), ("", ""), ("not JSON at all", "not JSON at all"),
])
def test_an_answer_cut_short_is_its_text_never_the_wire_format(text, content):
    out = tools.parse_output(text)
    assert out == tools.ParsedOutput(content)
