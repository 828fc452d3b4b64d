"""Structured output and tool calls against SmolLM2 over real HTTP with the real `openai`
client: response_format, llama.cpp's grammar, a park in the middle of a constrained output,
tool calls (plain, streamed, named, none, a round trip), and langchain when installed."""

import json
import re

import jsonschema
import pytest
from pydantic import BaseModel
from serverproc import ServerProcess

GREEDY = {"temperature": 0, "max_tokens": 80}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                "minItems": 2, "maxItems": 3}},
    "required": ["name", "age", "hobbies"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
APPLE = "Reply with a JSON object with the keys name and color for a red apple."
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(smollm2_openai):
    return smollm2_openai


def test_json_object_output_parses(client):
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": APPLE}],
        response_format={"type": "json_object"}, **GREEDY)
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_strict_json_schema_output_validates(client):
    out = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Invent a person."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA, "strict": True}}, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(
        model="x", messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, **GREEDY)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


def test_llama_grammar_and_json_schema_on_completion(server):
    body = {"prompt": "Q: Is the sky blue?\nA:", "n_predict": 10, "temperature": 0}
    answer = server.post("/completion", {**body, "grammar": 'root ::= " yes" | " no"'}).json()
    assert answer["content"] in (" yes", " no") and answer["stop_type"] == "eos"
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}},
              "required": ["answer"]}
    out = server.post("/completion", {**body, "n_predict": 30, "json_schema": schema}).json()
    jsonschema.validate(json.loads(out["content"]), schema)
    # llama-server accepts them on the OpenAI endpoints too
    completion = server.post("/v1/completions", {"prompt": body["prompt"], "max_tokens": 10,
                                                 "grammar": 'root ::= " yes" | " no"'}).json()
    assert completion["choices"][0]["text"] in (" yes", " no")


def test_vllms_structured_outputs_each_kind(client):
    """vLLM's current field, through the openai client's extra_body as vLLM's docs show it."""
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]

    def content(constraint, max_tokens=30):
        out = client.chat.completions.create(
            model="x", messages=ask, temperature=0, max_tokens=max_tokens,
            extra_body={"structured_outputs": constraint})
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        return out.choices[0].message.content

    assert content({"choice": ["Positive", "Negative"]}) in ("Positive", "Negative")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", content({"regex": "[0-9]{3}-[a-z]{2}"}))
    schema = {"type": "object", "properties": {"sky": {"type": "boolean"}},
              "required": ["sky"], "additionalProperties": False}
    jsonschema.validate(json.loads(content({"json": schema})), schema)
    jsonschema.validate(json.loads(content({"json": json.dumps(schema)})), schema)
    assert content({"grammar": 'root ::= "yes" | "no"'}) in ("yes", "no")
    assert isinstance(json.loads(content({"json_object": True}, 60)), dict)


def test_vllms_older_guided_fields_still_constrain(server):
    out = server.post("/v1/completions", {"prompt": "The sky is", "max_tokens": 10,
                                          "temperature": 0, "guided_choice": [" blue", " red"]})
    assert out.json()["choices"][0]["text"] in (" blue", " red")


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "[0-9]+", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_structured_outputs_are_400s_naming_the_field(server, extra, param):
    response = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert server.chat("still there?", max_tokens=2).status_code == 200


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/completion", {"grammar": "root ::= undefined-rule"}, "grammar"),
    ("/completion", {"json_schema": {"type": "color"}}, "json_schema"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, "tool_choice"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(server, path, extra, param):
    base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "hi"}
    response = server.post(path, {**base, "max_tokens": 4, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert server.chat("still there?", max_tokens=2).status_code == 200


SELF_REFERENCES = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
]


def as_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("schema", SELF_REFERENCES, ids=["ref-root", "defs-self", "defs-mutual"])
@pytest.mark.parametrize("path,field,param", [
    ("/v1/chat/completions", as_format, "response_format.json_schema.schema"),
    ("/v1/completions", as_format, "response_format.json_schema.schema"),
    ("/completion", lambda schema: {"json_schema": schema}, "json_schema"),
], ids=["chat", "completions", "llama"])
def test_a_schema_that_only_refers_to_itself_is_a_400_not_an_empty_answer(
        server, schema, path, field, param):
    """No JSON value can even begin: the answer was "" ending on EOS, as if it were valid."""
    base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "hi"}
    response = server.post(path, {**base, "max_tokens": 8, **field(schema)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "itself" in error["message"], error


TREE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["name"], "additionalProperties": False}


@pytest.mark.parametrize("path,field", [
    ("/v1/completions", as_format(TREE)), ("/completion", {"json_schema": TREE})])
def test_a_recursive_schema_with_a_way_out_still_answers_valid_json(server, path, field):
    # a few shots, so greedy SmolLM2 closes the tree instead of nesting until max_tokens
    prompt = '{"name": "Ann", "children": []}\n{"name": "Bob", "children": [{"name": "Cy"}]}\n'
    response = server.post(path, {"prompt": prompt, "max_tokens": 60, "temperature": 0,
                                  **field})
    assert response.status_code == 200, response.text
    out = response.json()
    text = out["choices"][0]["text"] if "choices" in out else out["content"]
    jsonschema.validate(json.loads(text), TREE)


def test_a_park_mid_output_keeps_the_grammar_state():
    """A recompute park (--preempt-ram 0) replays the output so far: those tokens must not
    reach the grammar a second time. Parks forced every 10 tokens (not an admin park at a
    polled moment: the output can end before it lands) against a server that never parks. The
    seeded tiny model (its random logits make the grammar do all the work) shares SmolLM2's
    tokenizer."""
    bounded = {"type": "object", "properties": {  # at most ~100 tokens, whatever the model
        "name": {"type": "string", "maxLength": 20}, "happy": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "minItems": 2, "maxItems": 3}},
        "required": ["name", "happy", "hobbies"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Invent a person with hobbies."}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "p", "schema": bounded}}, "temperature": 0, "max_tokens": 300}
    flags = ["-np", "2", "-c", "2048", "--preempt-ram", "0"]
    with ServerProcess(flags) as calm:
        reference = calm.post("/v1/chat/completions", body).json()
    with ServerProcess(flags, env={"KVPARK_PREEMPT_EVERY": "10"}) as parking:
        got = parking.post("/v1/chat/completions", body).json()
    assert reference["choices"][0]["finish_reason"] == "stop"
    parks = (reference["usage"]["completion_tokens"] - 1) // 10  # every 10 tokens, not at the end
    assert got["preempt"] == {"parks": parks, "recomputes": parks} and parks >= 2
    content = got["choices"][0]["message"]["content"]
    assert content == reference["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), bounded)


def test_tool_call_round_trip(client):
    first = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, CLOCK],
                                           tool_choice="required", **GREEDY)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    final = client.chat.completions.create(model="x", messages=history, tools=[WEATHER, CLOCK],
                                           tool_choice="none", temperature=0, max_tokens=20)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].message.content
    alone = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, CLOCK],
                                           tool_choice="none", max_tokens=1)
    # the call and its result are in the prompt (tests/unit/test_grammar.py checks the text)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 30


def test_auto_gives_a_call_or_an_answer(client):
    out = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER], **GREEDY)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    else:
        assert choice.finish_reason == "stop" and choice.message.content


def test_streamed_tool_calls_accumulate_in_the_openai_helper(client):
    with client.chat.completions.stream(model="x", messages=ASK, tools=[WEATHER],
                                        tool_choice="required", **GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"]


def test_a_tool_call_cut_short_by_max_tokens_is_still_a_tool_call(client):
    """As OpenAI answers a call cut short: finish_reason "length", the call with its arguments
    as far as they got; never kvpark's internal {"tool_calls": ...} text as content."""
    ask = {"model": "x", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
           "temperature": 0}
    whole = client.chat.completions.create(**ask, max_tokens=80)
    name = whole.choices[0].message.tool_calls[0].function.name
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    for limit in range(whole.usage.completion_tokens - 1, 0, -1):  # the last cut inside them
        choice = client.chat.completions.create(**ask, max_tokens=limit).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None, choice
        call = choice.message.tool_calls[0]
        assert call.function.name == name and call.id.startswith("call_")
        if call.function.arguments != arguments:
            break
    assert call.function.arguments.startswith("{") and "tool_calls" not in call.function.arguments
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # not whole: the client can tell

    chunks = [c.choices[0] for c in client.chat.completions.create(
        **ask, max_tokens=limit, stream=True) if c.choices]
    streamed = [d for c in chunks for d in c.delta.tool_calls or []]
    assert chunks[-1].finish_reason == "length" and not any(c.delta.content for c in chunks)
    assert [d.function.arguments for d in streamed] == [call.function.arguments]

    early = client.chat.completions.create(**ask, max_tokens=3).choices[0]
    assert early.finish_reason == "length" and not early.message.tool_calls
    assert early.message.content == ""  # nothing whole yet, and no wire format


def test_tool_choice_none_and_named(client):
    none = client.chat.completions.create(model="x", messages=ASK, tools=[WEATHER, CLOCK],
                                          tool_choice="none", temperature=0, max_tokens=10)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")
    named = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, **GREEDY)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]


def test_langchain_structured_output_and_bind_tools(server):
    chat_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed").ChatOpenAI
    llm = chat_openai(base_url=f"{server.url}/v1", api_key="unused", model="x",
                      temperature=0, max_tokens=80, max_retries=0)
    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person) and person.name
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK[0]["content"])
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
