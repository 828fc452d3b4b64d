"""Requests built to take the server down, each answered with a 400 naming its field while the
server keeps serving: grammars and schemas that crash llguidance's compiler (a native stack
overflow, which no Python code can catch: compiled first in a child process), JSON text nested
past what the decoder follows, and bodies whose decoding alone would cost seconds."""

import json

import httpx
import pytest
from serverproc import ServerProcess

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["-np", "2", "-c", "1024"]) as s:
        yield s


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "a"'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"'


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_defs(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def as_response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


# what an outside tester sent to main 20323f2: each killed the whole process (SIGSEGV)
CRASHERS = {
    "lark chain of 3000": ({"grammar": lark_chain(3000)}, "grammar"),
    "gbnf chain of 5000": ({"grammar": gbnf_chain(5000)}, "grammar"),
    "$ref chain of 3000": (as_response_format(ref_chain(3000)),
                           "response_format.json_schema.schema"),
    "1000 nested $defs": (as_response_format(nested_defs(1000)),
                          "response_format.json_schema.schema"),
}


def assert_serving(server) -> None:
    """Alive, and a constrained request still compiles (the checker was started again)."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    answer = server.post(CHAT, {"messages": MSG, "max_tokens": 3,
                                **as_response_format({"type": "object"})})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("name", CRASHERS)
def test_a_grammar_that_crashes_the_grammar_engine_is_a_400_and_the_server_lives(server, name):
    fields, param = CRASHERS[name]
    response = server.post(CHAT, {"messages": MSG, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "crashed compiling it" in error["message"]
    assert_serving(server)


LADDER = [10, 300, 1000, 2000, 3000, 6000, 12000]
KINDS = {
    "lark chain": lambda n: ({"grammar": lark_chain(n)}, "grammar"),
    "$ref chain": lambda n: (as_response_format(ref_chain(n)),
                             "response_format.json_schema.schema"),
    "nested $defs": lambda n: (as_response_format(nested_defs(n)),
                               "response_format.json_schema.schema"),
    "regex groups": lambda n: ({"structured_outputs": {"regex": "(" * n + "a" + ")" * n}},
                               "structured_outputs.regex"),
    "choices": lambda n: ({"structured_outputs": {"choice": [f"c{i}" for i in range(n)]}},
                          "structured_outputs.choice"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_grammars_of_every_size_and_depth_are_answered_and_never_kill_the_server(server, kind):
    """A ladder of depths and sizes up to what an 8 MiB body holds: each one compiles (200)
    or is refused naming its field (400); the server answers every rung."""
    seen = set()
    for n in LADDER:
        fields, param = KINDS[kind](n)
        response = server.post(CHAT, {"messages": MSG, "max_tokens": 2, **fields})
        assert response.status_code in (200, 400), (n, response.text)
        if response.status_code == 400:
            assert response.json()["error"]["param"] == param, (n, response.text)
        seen.add(response.status_code)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert 200 in seen  # the small rungs compile
    assert_serving(server)


def deep_json(n: int) -> str:
    return '{"a": ' + "[" * n + "]" * n + "}"


DEEP_ARGUMENTS = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_json(5000)}}]}]
DEEP_TEXT = [
    (CHAT, {"messages": DEEP_ARGUMENTS, "max_tokens": 2},
     "messages[1].tool_calls[0].function.arguments"),
    ("/tokenize", {"messages": DEEP_ARGUMENTS}, "messages[1].tool_calls[0].function.arguments"),
    ("/apply-template", {"messages": DEEP_ARGUMENTS},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_json": deep_json(5000)},
     "structured_outputs.json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2,
                         "structured_outputs": {"json": deep_json(5000)}},
     "structured_outputs.json"),
]


@pytest.mark.parametrize("path,body,param", DEEP_TEXT, ids=[
    "chat arguments", "tokenize", "apply-template", "guided_json", "structured_outputs"])
def test_json_text_nested_too_deeply_in_a_field_is_a_400_naming_it(server, path, body, param):
    response = server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "nests too deeply" in error["message"]


def test_a_body_of_more_arrays_than_any_request_needs_is_refused_before_decoding(server):
    """600,000 logit_bias pairs: 1.2 million lists to build before any field is read."""
    pairs = "[" + ",".join(["[1,1]"] * 600_000) + "]"
    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
            f'"logit_bias": {pairs}}}').encode()
    response = httpx.post(f"{server.url}{CHAT}", content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "body" and "JSON arrays and objects" in error["message"]
    # brackets inside strings are not arrays: a body full of them is read
    answer = server.post("/tokenize", {"content": "hi", "note": "[{" * 40_000})
    assert answer.status_code == 200, answer.text


def test_detokenize_takes_no_more_tokens_than_a_context_holds(server):
    response = server.post("/detokenize", {"tokens": [5] * 1025})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    assert server.post("/detokenize", {"tokens": [5] * 1024}).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": MSG, "user": 5}, "user"),
    (CHAT, {"messages": MSG, "metadata": "x"}, "metadata"),
    (CHAT, {"messages": MSG, "metadata": {"k": 1}}, "metadata"),
    (CHAT, {"messages": MSG, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    (CHAT, {"messages": MSG, "store": "yes"}, "store"),
    (CHAT, {"messages": MSG, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    (CHAT, {"messages": MSG, "service_tier": ["auto"]}, "service_tier"),
    ("/completion", {"prompt": "hi", "cache_prompt": "yes"}, "cache_prompt"),
    ("/completion", {"prompt": "hi", "n_predict": 2, "max_tokens": "lots"}, "max_tokens"),
    ("/completion", {"prompt": "hi", "stream_options": "x"}, "stream_options"),
])
def test_fields_without_effect_are_still_held_to_their_type(server, path, body, param):
    """As OpenAI and llama-server hold them: a client's mistake is not silently taken."""
    response = server.post(path, {"max_tokens": 2, **body} if path == CHAT else body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_same_fields_of_the_right_type_are_taken(server):
    chat = server.post(CHAT, {"messages": MSG, "max_tokens": 2, "user": "u", "store": False,
                              "metadata": {"k": "v"}, "parallel_tool_calls": True,
                              "service_tier": "auto", "prompt_cache_key": "p"})
    assert chat.status_code == 200, chat.text
    llama = server.post("/completion", {"prompt": "hi", "n_predict": 2, "max_tokens": 9,
                                        "cache_prompt": True, "stream_options": None})
    assert llama.status_code == 200, llama.text
    assert len(llama.json()["tokens"] if "tokens" in llama.json() else [0, 0]) <= 2
    assert json.loads(llama.text)["tokens_predicted"] == 2  # n_predict won


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for level in range(depth):
        schema = {"type": "object", "description": "a level of nesting " * 4,
                  "properties": {f"field_at_level_{level}": schema}}
    return schema


def test_a_prompt_that_renders_past_the_limit_from_tool_schemas_is_refused_before_tokenising(
        server):
    """The messages are one word; 64 nested tool schemas render to far more than the 32,768
    characters a 1024-token context can hold (--max-prompt-chars): refused after rendering,
    before the tokenizer runs over it (which took seconds for ~200,000 tokens)."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "x",
                                               "parameters": nested_schema(40)}}
             for i in range(64)]
    for path in (CHAT, "/tokenize", "/apply-template"):
        body = {"messages": MSG, "tools": tools}
        response = server.post(path, {**body, "max_tokens": 2} if path == CHAT else body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == "messages" and "rendered" in error["message"], path
    small = [{"type": "function", "function": {"name": "f", "parameters": nested_schema(2)}}]
    answer = server.post(CHAT, {"messages": MSG, "max_tokens": 2, "tools": small})
    assert answer.status_code == 200, answer.text
