"""Reasoning output over HTTP (issue 43) on the real SmolLM2, through real clients: a think block
opened by the prompt (an assistant prefill of `<think>`, as a thinking template's generation
prompt opens one) comes back as `reasoning_content` (chat), a `thinking` block (the `anthropic`
SDK) and a reasoning item (the `openai` SDK's Responses), each stream giving the same text; the
budget forces the end tag after its tokens; a JSON schema applies after the block.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from kvpark.pod.sampling.reasoning import ThinkingRule, split_reasoning

BUDGET = 6
OPEN_BLOCK = [{"role": "user", "content": "Write a long story about a cat named Tom."},
              {"role": "assistant", "content": "<think>\n"}]  # the block the output starts in
THINKING = {"temperature": 0, "reasoning_format": "deepseek", "thinking_budget_tokens": BUDGET}


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


def chat(server, body: dict) -> dict:
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.fixture(scope="module")
def answer(server):
    return chat(server, {"messages": OPEN_BLOCK, "max_tokens": 24, "logprobs": True,
                         **THINKING})


def test_the_block_is_returned_apart_from_the_answer(server, answer):
    message = answer["choices"][0]["message"]
    # deepseek-legacy: the text as written, tags and all, beside the same reasoning
    raw = chat(server, {"messages": OPEN_BLOCK, "max_tokens": 24, **THINKING,
                        "reasoning_format": "deepseek-legacy"})["choices"][0]["message"]
    assert raw["reasoning_content"] == message["reasoning_content"]
    assert "</think>" in raw["content"]
    split = split_reasoning(raw["content"], ThinkingRule(opened=True))
    assert message["reasoning_content"] == message["reasoning"] == split.reasoning
    assert message["content"] == split.content and message["content"]


def test_the_budget_forces_the_end_tag_after_its_tokens(server, answer):
    tokens = [entry["token"] for entry in answer["choices"][0]["logprobs"]["content"]]
    rest = "".join(tokens[BUDGET:])
    assert rest.startswith("</think>")  # the model's own next token was not the tag
    assert "".join(tokens[:BUDGET]).strip() == answer["choices"][0]["message"]["reasoning"]


def test_a_stream_sends_the_same_reasoning_and_content(server, answer):
    chunks = streamed(server, {"messages": OPEN_BLOCK, "max_tokens": 24, **THINKING})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(d.get("content") != "" and d.get("reasoning_content") != "" for d in deltas)
    message = answer["choices"][0]["message"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning_content") for d in deltas[first_content:])


def test_a_json_schema_applies_once_the_block_ends(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    message = chat(server, {"messages": OPEN_BLOCK, "max_tokens": 60, **THINKING,
                            "response_format": {"type": "json_schema", "json_schema": {
                                "name": "cat", "schema": schema}}})["choices"][0]["message"]
    assert message["reasoning_content"]  # free text: the grammar waited
    assert set(json.loads(message["content"])) == {"name"}


def test_the_anthropic_sdk_gets_a_thinking_block_then_the_text(server, answer):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kwargs = {"model": "m", "max_tokens": 24, "messages": OPEN_BLOCK,
              "thinking": {"type": "enabled", "budget_tokens": BUDGET},
              "extra_body": {"temperature": 0, "reasoning_format": "deepseek"}}
    whole = client.messages.create(**kwargs)
    message = answer["choices"][0]["message"]
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == message["reasoning"]
    assert whole.content[1].text == message["content"]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]


def test_the_responses_api_gives_a_reasoning_item_then_the_message(smollm2_openai, answer):
    client = smollm2_openai
    kwargs = {"model": "m", "max_output_tokens": 24, "input": OPEN_BLOCK,
              "extra_body": {"temperature": 0, "reasoning_format": "deepseek",
                             "thinking_budget_tokens": BUDGET}}
    whole = client.responses.create(**kwargs)
    message = answer["choices"][0]["message"]
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == message["reasoning"]
    assert whole.output_text == message["content"]
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == message["reasoning"]
    assert [(i.type, i.content[0].text) for i in final.output] == \
        [(i.type, i.content[0].text) for i in whole.output]
