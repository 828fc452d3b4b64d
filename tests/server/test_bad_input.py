"""At least 30 malformed requests: each gets a 4xx whose OpenAI-style error names the field,
and the server answers a good request right after each one."""

import httpx
import pytest
from serverproc import ServerProcess, free_port, poll

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["-np", "2", "-c", "1024", "--max-body-bytes", "4096"]) as s:
        yield s


JSON_CASES = [
    # (path, body, status, field named in the error)
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": ["hello"]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 10**12}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 2.5}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "max_completion_tokens": "9"}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": 9}, 400, "temperature"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"messages": MSG, "top_k": -7}, 400, "top_k"),
    (CHAT, {"messages": MSG, "min_p": 2}, 400, "min_p"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"messages": MSG, "n": 100000}, 400, "n"),
    (CHAT, {"messages": MSG, "seed": "abc"}, 400, "seed"),
    (CHAT, {"messages": MSG, "seed": 1.5}, 400, "seed"),
    (CHAT, {"messages": MSG, "stop": 7}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ["a"] * 50}, 400, "stop"),
    (CHAT, {"messages": MSG, "stop": ["a", "b" * 1025]}, 400, "stop"),  # over MAX_STOP_CHARS
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    (CHAT, {"messages": MSG, "stream_options": "x"}, 400, "stream_options"),
    (CHAT, {"messages": MSG, "ignore_eos": 1}, 400, "ignore_eos"),
    (CHAT, {"messages": MSG, "model": 3}, 400, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1, 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x " * 1100}, 400, "prompt"),  # longer than the pool
    # n sequences side by side (2 slots here) that cannot all fit the 1024-token pool
    ("/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": 600, "ignore_eos": True}, 400,
     "n"),
    (CHAT, {"messages": MSG, "n": 2, "max_tokens": 600}, 400, "n"),
    # 600 prompt tokens (37 full pages shared by the siblings) + 300 each: 77 of 64 pages
    ("/v1/completions", {"prompt": list(range(100, 700)), "n": 2, "max_tokens": 300}, 400, "n"),
    ("/completion", {"prompt": "hi", "n_predict": -5}, 400, "n_predict"),
    ("/completion", {"prompt": "hi", "n_predict": 0}, 400, "n_predict"),  # as /openapi.json says
    ("/completion", {"prompt": "hi", "n": 2}, 400, "n"),
    (CHAT, {"messages": MSG, "temperature": 10**400}, 400, "temperature"),  # past a float
    # OpenAI requires content but on an assistant message with tool calls (unsupported)
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "system"}, *MSG]}, 400, "messages[0].content"),
    (CHAT, {"messages": [*MSG, {"role": "assistant"}, *MSG]}, 400, "messages[1].content"),
    (CHAT, {"messages": [*MSG, {"role": "tool", "tool_call_id": "c1"}]}, 400,
     "messages[1].content"),
]

RAW_CASES = [
    # (body bytes, status, field)
    (b"{not json", 400, "body"),
    (b"", 400, "body"),
    (b"[1, 2, 3]", 400, "body"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "body"),  # bad UTF-8
    (b'{"messages": "' + b"x" * 5000 + b'"}', 413, "body"),  # over --max-body-bytes
    (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["a", "\\udc00"]}', 400,
     "stop[1]"),
    (b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 4000 + b"}", 400,
     "seed"),  # 4000 digits: under Python's limit, out of range; echoed in part
    (b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400, "body"),
]


def assert_error(response, status, field):
    assert response.status_code == status, response.text
    assert len(response.content) < 1000, response.content[:300]  # quotes of input are cut
    error = response.json()["error"]
    assert error["param"] == field
    assert field in error["message"] or field in ("body", "prompt", "messages")
    assert error["type"] and isinstance(error["message"], str)


def assert_still_serving(server):
    ok = server.chat("are you there", max_tokens=3, temperature=0)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("path,body,status,field", JSON_CASES)
def test_malformed_json_request(server, path, body, status, field):
    assert_error(server.post(path, body), status, field)
    assert_still_serving(server)


@pytest.mark.parametrize("raw,status,field", RAW_CASES)
def test_malformed_raw_body(server, raw, status, field):
    response = httpx.post(f"{server.url}{CHAT}", content=raw,
                          headers={"content-type": "application/json"}, timeout=30)
    assert_error(response, status, field)
    assert_still_serving(server)


UNSUPPORTED_CASES = [
    # (path, extra fields, param): a client asking for these must not get plain text back
    # (structured output and tools: tests/server/test_structured_output.py)
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": {"name": "f"}}, "function_call"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
]


@pytest.mark.parametrize("path,extra,param", UNSUPPORTED_CASES)
def test_unsupported_field_is_refused_by_name(server, path, extra, param):
    base = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    response = server.post(path, {**base, "max_tokens": 2, **extra})
    assert_error(response, 400, param)
    assert "not supported" in response.json()["error"]["message"]


HARMLESS = {
    # what clients send by default, or that asks for nothing this server does not do
    "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "parallel_tool_calls": True, "response_format": {"type": "text"}, "logprobs": False,
    "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
    "tools": None, "tool_choice": "none", "functions": None, "function_call": None,
    "stream_options": None, "n": 1, "seed": None, "modalities": ["text"],
}


def test_harmless_and_null_fields_still_work(server):
    chat = server.post(CHAT, {"messages": MSG, "max_tokens": 2, **HARMLESS})
    assert chat.status_code == 200, chat.text
    # langchain's legacy completions defaults
    body = {"prompt": "hi", "model": "x", "temperature": 0.7, "top_p": 1, "n": 1,
            "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "best_of": 1,
            "logprobs": None, "echo": False, "suffix": None, "max_tokens": 2}
    assert server.post("/v1/completions", body).status_code == 200
    assert server.post("/completion", {"prompt": "hi", "n_predict": 2, "cache_prompt": True,
                                       "repeat_penalty": 1.0, "n_probs": 0}).status_code == 200


@pytest.mark.parametrize("path,base", [
    (CHAT, {"messages": MSG}), ("/v1/completions", {"prompt": "hi"}),
    ("/v1/completions", {"prompt": ["hi", "ho"]})], ids=["chat", "completions", "batch"])
def test_stream_options_without_stream_is_refused_as_openai_and_vllm_do(server, path, base):
    """A client asking for a streamed usage chunk on a plain answer would get none."""
    for extra in ({}, {"stream": False}, {"stream": None}):
        for options in ({"include_usage": True}, {"include_usage": False}):
            body = {**base, "max_tokens": 2, **extra, "stream_options": options}
            response = server.post(path, body)
            assert_error(response, 400, "stream_options")
            assert "stream=True" in response.json()["error"]["message"]
    for options in (None, {}):  # they ask for nothing: vLLM takes them too
        body = {**base, "max_tokens": 2, "stream_options": options}
        assert server.post(path, body).status_code == 200
    streamed = {**base, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    assert server.post(path, streamed).status_code == 200


def test_unknown_fields_are_ignored_and_logged_once_by_name(server):
    pattern = r"present in the request but ignored: \{'temprature'\}"
    for _ in range(2):
        response = server.post(CHAT, {"messages": MSG, "max_tokens": 2, "temprature": 0.1})
        assert response.status_code == 200, response.text
    assert server.count_in_log(pattern) == 1


def assert_json_error(response, status):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and error["code"] == status


def test_unknown_paths_and_methods_get_json_errors(server):
    assert_json_error(httpx.get(f"{server.url}/v1/nope"), 404)
    assert "/v1/nope" in httpx.get(f"{server.url}/v1/nope").json()["error"]["message"]
    wrong_method = httpx.get(f"{server.url}{CHAT}")
    assert_json_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"
    assert_json_error(httpx.delete(f"{server.url}/slots"), 405)


@pytest.mark.parametrize("path", ["/slots/", "/health/", "/v1/models/"])
def test_trailing_slash_is_a_json_404_not_a_redirect_to_the_host_header(server, path):
    response = httpx.get(f"{server.url}{path}", headers={"Host": "evil.example"})
    assert_json_error(response, 404)
    assert "evil.example" not in response.headers.get("location", "")
    assert "location" not in response.headers
    assert_json_error(server.post(f"{CHAT}/", {"messages": MSG}), 404)


def test_error_messages_quote_a_bad_value_only_in_part(server):
    response = server.post(CHAT, {"messages": [{"role": "w" * 3000, "content": "x"}]})
    assert_error(response, 400, "messages[0].role")
    message = response.json()["error"]["message"]
    assert "www" in message and len(message) < 300


def test_an_unexpected_exception_in_a_route_is_a_json_500():
    """No route fails this way on purpose, so one is added to the app, served by uvicorn
    in-process on a loopback port (no model needed: its loading is left out)."""
    import threading

    import uvicorn
    from starlette.routing import Route

    from kvpark.pod.args import ServerArgs
    from kvpark.pod.http.app import create_app

    async def broken(request):
        raise RuntimeError("a bug")

    app = create_app(ServerArgs(model="synthetic:tiny"))
    app.router.routes.append(Route("/broken", broken))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                       log_level="critical"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        poll(lambda: uv.started, "uvicorn to listen")
        response = httpx.get(f"http://127.0.0.1:{port}/broken", timeout=30)
    finally:
        uv.should_exit = True
        thread.join(30)
    assert_json_error(response, 500)
    assert response.json()["error"]["type"] == "server_error"


LONG = "x " * 900  # most of the 1024-token pool: what is left to generate is short


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1024, "ignore_eos": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1024,
                      "ignore_eos": True}),
    ("/v1/responses", {"input": LONG, "max_output_tokens": 1024, "ignore_eos": True}),
])
def test_more_to_generate_than_the_context_holds_runs_until_it_is_full(server, path, body):
    """Issue 43 (7): as llama-server does (vLLM answers 400): the output ends when the
    prompt and it fill the context, with the API's word for a length stop. (The Anthropic and
    Responses routes answered 500 here: the refusal looked up fields they lack.)"""
    response = server.post(path, body)
    assert response.status_code == 200, response.text
    out = response.json()
    if path == "/v1/completions":
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["total_tokens"] == 1024  # -c: one sequence may fill the pool
    elif path == "/v1/messages":
        assert out["stop_reason"] == "max_tokens"
    else:
        assert out["status"] == "incomplete"


def test_there_are_at_least_thirty_cases():
    assert len(JSON_CASES) + len(RAW_CASES) >= 30


def test_an_exception_in_one_request_spares_the_others():
    """KVPARK_INJECT_FAULT_TOKEN makes any step holding that token id fail: the request that
    holds it ends with an error, the one beside it finishes with the same bytes as alone."""
    import concurrent.futures as cf

    poison = 4242
    body = {"prompt": [1000, 1001, 1002], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with ServerProcess(["-np", "2", "-c", "1024"],
                       env={"KVPARK_INJECT_FAULT_TOKEN": str(poison)}) as s:
        alone = s.post("/v1/completions", body).json()["choices"][0]["text"]
        with cf.ThreadPoolExecutor(2) as pool:
            bad = pool.submit(s.post, "/v1/completions", {**body, "prompt": [poison, 7, 8]})
            good = pool.submit(s.post, "/v1/completions", body)
            bad, good = bad.result(), good.result()
        assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == alone
        assert s.post("/v1/completions", body).status_code == 200


def test_n_siblings_that_fit_only_by_sharing_the_prompt_pages_are_accepted_and_finish(server):
    """600 prompt tokens + 100 each, n=2, on 64 pages: 88 pages apart, 51 with the prompt's
    37 full pages shared (the prefix cache is on), so it is admitted and both finish."""
    body = {"prompt": list(range(100, 700)), "n": 2, "max_tokens": 100, "ignore_eos": True,
            "temperature": 0.8, "seed": 5}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert [c["finish_reason"] for c in data["choices"]] == ["length", "length"]
    assert data["usage"]["completion_tokens"] == 200
