"""OpenAI's Responses API (`POST /v1/responses`, issue 43) through the real `openai` SDK:
the text the same conversation gets from /v1/chat/completions (greedy), the stream and its
events, a tool round trip continued by `previous_response_id`, `text.format`, `store: false`
and errors naming the field.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": TOOLS[0]["parameters"]}}]
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(smollm2_openai):
    return smollm2_openai


def chat(server, body: dict) -> dict:
    response = server.post("/v1/chat/completions", {**body, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_response_is_what_chat_completions_answer(server, client):
    response = client.responses.create(model="m", input="Hello there", instructions="Be brief.",
                                       max_output_tokens=24, temperature=0)
    reference = chat(server, {"max_tokens": 24, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == reference["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == reference["usage"]["completion_tokens"]
    cut = reference["choices"][0]["finish_reason"] == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.instructions == "Be brief." and response.max_output_tokens == 24


def test_a_stream_sends_the_same_text_in_numbered_events(server, client):
    kwargs = {"model": "m", "input": ASK, "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == whole.output_text == final.output_text
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**kwargs, "stream": True,
                                                                   "max_output_tokens": 3},
                      timeout=60) as response:
        data = [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ")]
    assert [d["type"] for d in data] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * 3,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_a_tool_round_trip_continued_by_previous_response_id(server, client):
    first = client.responses.create(model="m", input=ASK, tools=TOOLS, tool_choice="required",
                                    temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    with client.responses.stream(model="m", input=ASK, tools=TOOLS, tool_choice="required",
                                 temperature=0) as stream:
        streamed = stream.get_final_response()
    assert [i.arguments for i in streamed.output if i.type == "function_call"] == [call.arguments]
    second = client.responses.create(
        model="m", previous_response_id=first.id, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 C"}], max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    # the stored conversation, the call (its id as sent) and its output are the prompt
    reference = chat(server, {"max_tokens": 1, "tools": CHAT_TOOLS, "tool_choice": "none",
                              "messages": [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]})
    assert second.usage.input_tokens == reference["usage"]["prompt_tokens"]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.responses.create(
        model="m", input="Invent a person.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_store_false_and_unknown_ids_cannot_be_continued(client):
    kept = client.responses.create(model="m", input="Hi", max_output_tokens=2)
    assert client.responses.create(model="m", input="Again", previous_response_id=kept.id,
                                   max_output_tokens=2).output
    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model="m", input="Again", previous_response_id=response_id)
        assert refused.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
])
def test_bad_requests_name_the_field(server, body, param):
    response = server.post("/v1/responses", {"model": "m", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
