"""Anthropic's Messages API (`POST /v1/messages`, issue 43) through the real `anthropic` SDK:
a message and a stream give the text the same conversation gets from /v1/chat/completions
(greedy), a tool round trip, stop sequences, token counting, errors in Anthropic's shape and
`x-api-key`.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from serverproc import ServerProcess

KEY = "test-key"
GREEDY = {"temperature": 0}  # the SDK no longer takes sampling fields: sent as extra_body
TOOLS = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The real SmolLM2 (shared with other modules): a tool call it writes is short."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat(server: ServerProcess, body: dict) -> dict:
    response = server.post("/v1/chat/completions", {**body, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_message_is_what_chat_completions_answer(server, client):
    message = client.messages.create(model="m", max_tokens=24, system="Be brief.",
                                     messages=[{"role": "user", "content": "Hello there"}],
                                     extra_body=GREEDY)
    reference = chat(server, {"max_tokens": 24, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]})
    assert message.id.startswith("msg_") and message.role == "assistant"
    [block] = message.content
    assert block.type == "text" and block.text == reference["choices"][0]["message"]["content"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        reference["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == reference["usage"]["completion_tokens"]
    reason = reference["choices"][0]["finish_reason"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reason]


def test_a_stream_sends_the_same_text_in_anthropics_events(server, client):
    kwargs = {"model": "m", "max_tokens": 24, "messages": ASK, "extra_body": GREEDY}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 24
    with httpx.stream("POST", f"{server.url}/v1/messages", json={
            "model": "m", "max_tokens": 4, "messages": ASK, "stream": True, **GREEDY},
            ) as response:
        names = [line[7:] for line in response.iter_lines() if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * 4,
                     "content_block_stop", "message_delta", "message_stop"]


def test_a_tool_round_trip(server, client):
    first = client.messages.create(model="m", max_tokens=60, tools=TOOLS, messages=ASK,
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    with client.messages.stream(model="m", max_tokens=60, tools=TOOLS, messages=ASK,
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    turns = [*ASK, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model="m", max_tokens=8, tools=TOOLS, messages=turns,
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens")
    # the result reached the prompt as the chat template's tool message
    counted = client.messages.count_tokens(model="m", tools=TOOLS, messages=turns,
                                           tool_choice={"type": "none"})
    arguments = json.dumps(use.input, ensure_ascii=False)
    openai_turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"}]
    reference = chat(server, {"max_tokens": 1, "messages": openai_turns, "tool_choice": "none",
                              "tools": [{"type": "function", "function": {
                                  "name": "get_weather", "description": "The weather in a city",
                                  "parameters": TOOLS[0]["input_schema"]}}]})
    assert counted.input_tokens == reference["usage"]["prompt_tokens"]
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    free = client.messages.create(model="m", max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    message = client.messages.create(model="m", max_tokens=24, messages=ASK,
                                     stop_sequences=["@@never@@", stop], extra_body=GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert text.startswith(message.content[0].text) and stop not in message.content[0].text


@pytest.mark.parametrize("body, field", [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "messages[0].content[0].type"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(server, body, field):
    response = server.post("/v1/messages", body)
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"'{field}'" in error["error"]["message"]


@pytest.fixture(scope="module")
def parking_server():
    """The tiny model behind --api-key, every sequence parked every 8 tokens (by recompute)."""
    with ServerProcess(["-np", "1", "-c", "1024", "--api-key", KEY, "--preempt-ram", "0"],
                       env={"KVPARK_PREEMPT_EVERY": "8"}) as server:
        yield server


def test_x_api_key_is_the_key_and_a_wrong_one_an_authentication_error(parking_server):
    right = anthropic.Anthropic(base_url=parking_server.url, api_key=KEY, max_retries=0)
    assert right.messages.create(model="m", max_tokens=2, messages=ASK).content
    wrong = anthropic.Anthropic(base_url=parking_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model="m", max_tokens=2, messages=ASK)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_a_parked_stream_says_so_in_comments_and_sends_the_same_text(parking_server):
    """Parks are SSE comments (`: preempted`, `: resumed`), which the SDK skips; the text is
    what the same server answers in one piece."""
    client = anthropic.Anthropic(base_url=parking_server.url, api_key=KEY, max_retries=0)
    kwargs = {"model": "m", "max_tokens": 40, "messages": ASK, "extra_body": GREEDY}
    whole = client.messages.create(**kwargs).content[0].text
    with client.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == whole
    with httpx.stream("POST", f"{parking_server.url}/v1/messages", json={
            "model": "m", "max_tokens": 40, "messages": ASK, "stream": True, **GREEDY},
            headers={"x-api-key": KEY}) as response:
        lines = list(response.iter_lines())
    assert ": preempted" in lines and ": resumed" in lines
