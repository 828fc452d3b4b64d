"""The HTTP API over real loopback HTTP, on the seeded tiny model."""

import json

import httpx
import openai
import pytest

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def client(server, key="unused"):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_health_models_and_slots(tiny_server):
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{tiny_server.url}/v1/models").json()
    assert models["data"][0]["id"] == "synthetic:tiny"
    slots = tiny_server.slots()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["is_processing"] is False and s["n_ctx"] == 512 for s in slots)
    assert {"is_preempted", "n_preempt", "n_recompute", "preempt_mode"} <= slots[0].keys()


def test_chat_completion_has_usage_and_finish_reason(tiny_server):
    body = tiny_server.chat("hello there", **GREEDY).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12


def test_openai_client_streaming_equals_non_streaming(tiny_server):
    c = client(tiny_server)
    messages = [{"role": "user", "content": "tell me a story"}]
    extra = {"ignore_eos": True}
    full = c.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=20,
                                     extra_body=extra)
    chunks = list(c.chat.completions.create(
        model="x", messages=messages, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_body=extra))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_no_streamed_delta_carries_empty_content(tiny_server):
    """Issue 43 (7): the first delta opens with the role and content null, as llama-server and
    vLLM send it; text held back behind a possible stop string sends no `""` either."""
    body = {"messages": [{"role": "user", "content": "tell me a story"}], "stream": True,
            "stop": ["e", "a", " t"], "logprobs": True, **GREEDY}
    with httpx.stream("POST", f"{tiny_server.url}/v1/chat/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert all(d.get("content") != "" and "role" not in d for d in deltas[1:]), deltas


def test_completions_endpoint_and_n_choices(tiny_server):
    c = client(tiny_server)
    out = c.completions.create(model="x", prompt="The sky is", max_tokens=6, n=3,
                               temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    again = c.completions.create(model="x", prompt="The sky is", max_tokens=6, n=3,
                                 temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in out.choices]


def test_llama_completion_timings(tiny_server):
    body = tiny_server.post("/completion", {"prompt": "hello world", "n_predict": 5,
                                            "temperature": 0, "ignore_eos": True}).json()
    t = body["timings"]
    assert t["predicted_n"] == 5 and body["tokens_predicted"] == 5
    assert t["prompt_n"] == body["tokens_evaluated"] > 0
    assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0
    assert body["stop_type"] == "limit"


def test_llama_completion_streams(tiny_server):
    lines = []
    with httpx.stream("POST", f"{tiny_server.url}/completion", timeout=60,
                      json={"prompt": "hi", "n_predict": 4, "stream": True, "temperature": 0,
                            "ignore_eos": True}) as response:
        lines = [json.loads(line[6:]) for line in response.iter_lines()
                 if line.startswith("data: ")]
    assert lines[-1]["stop"] is True and lines[-1]["timings"]["predicted_n"] == 4
    assert all(line["stop"] is False for line in lines[:-1])


def test_stop_string_ends_generation_and_is_not_returned(tiny_server):
    free = tiny_server.chat("stop test", temperature=0, max_tokens=30, ignore_eos=True).json()
    text = free["choices"][0]["message"]["content"]
    stop = text[5:8]
    assert len(stop) == 3
    cut = tiny_server.chat("stop test", temperature=0, max_tokens=30, ignore_eos=True,
                           stop=[stop]).json()
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_greedy_is_independent_of_batch_neighbours(tiny_server):
    """The same prompt alone and alongside three others gives the same bytes."""
    import concurrent.futures as cf

    params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    alone = tiny_server.chat("the one prompt", **params).json()["choices"][0]["message"]
    others = ["a much longer neighbour prompt " * 6, "short", "middle sized neighbour " * 3]
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(tiny_server.chat, p, **params) for p in others]
        futures.append(pool.submit(tiny_server.chat, "the one prompt", **params))
        results = [f.result().json() for f in futures]
    assert results[-1]["choices"][0]["message"]["content"] == alone["content"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_bad_input_gets_400_naming_the_field(tiny_server, body, param):
    response = tiny_server.post("/v1/chat/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert tiny_server.chat("still serving", **GREEDY).status_code == 200


def test_malformed_json_gets_400(tiny_server):
    response = httpx.post(f"{tiny_server.url}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_prompt_longer_than_pool_is_rejected_before_it_starts(tiny_server):
    response = tiny_server.post("/v1/completions", {"prompt": list(range(100, 2200)),
                                                    "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("Context size has been exceeded.")


def test_metrics_count_tokens_and_batched_decode(tiny_server):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: tiny_server.chat(f"prompt {i}", temperature=0, max_tokens=30,
                                                 ignore_eos=True), range(4)))
    m = tiny_server.metrics()
    assert m["kvpark:tokens_predicted_total"] >= 120
    assert m["kvpark:prompt_tokens_total"] > 0
    assert m["kvpark:kv_cache_usage_ratio"] == 0.0
    # more than one sequence per decode step happened
    assert m['kvpark:decode_batch_size_bucket{le="1.0"}'] < m["kvpark:decode_batch_size_count"]


def test_top_p_zero_at_temperature_one_gives_the_greedy_text(tiny_server):
    greedy = tiny_server.chat("top p zero", temperature=0, max_tokens=24, ignore_eos=True)
    for seed in (1, 2):
        top_p_zero = tiny_server.chat("top p zero", temperature=1, top_p=0, seed=seed,
                                      max_tokens=24, ignore_eos=True)
        assert top_p_zero.json()["choices"][0]["message"]["content"] == \
            greedy.json()["choices"][0]["message"]["content"]


def test_n_beyond_the_slots_only_needs_the_slots_worth_of_pool(tiny_server):
    """6 sequences of 500 tokens on 4 slots and a 2048-token pool: 4 run side by side (2048
    tokens, less with their prompt's pages shared), the other 2 take their turn, so the request
    is accepted and finishes. Four of 740 tokens do not fit even sharing the 18 full prompt
    pages (18 + 4 x 29 of 128 pages)."""
    body = {"prompt": list(range(100, 400)), "n": 6, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0.8, "seed": 3}
    response = tiny_server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6 * 200
    too_long = tiny_server.post("/v1/completions", {**body, "max_tokens": 440})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "n"


def test_prompt_tokens_metric_counts_an_n_request_prompt_once(tiny_server):
    before = tiny_server.metric("kvpark:prompt_tokens_total")
    body = tiny_server.post("/v1/completions", {"prompt": "count me once", "n": 4,
                                                "max_tokens": 3, "ignore_eos": True}).json()
    after = tiny_server.metric("kvpark:prompt_tokens_total")
    assert body["usage"]["prompt_tokens"] > 0
    assert after - before == body["usage"]["prompt_tokens"]


def test_default_limits_refuse_huge_inputs_before_templating(tiny_server):
    """An 8 MiB prompt and 4097 messages are refused by the default limits (32 characters per
    token of context; 4096 messages) before the template and the tokenizer see them: the
    errors name the limit, not the context."""
    url = tiny_server.url
    max_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 8_000_000}]},
         "messages", "--max-prompt-chars"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 4000}] *
                                  (32 * max_len // 4000 + 1)}, "messages",
         "--max-prompt-chars"),
        ("/v1/completions", {"prompt": "z" * (32 * max_len + 1)}, "prompt",
         "--max-prompt-chars"),
        ("/completion", {"prompt": ["z" * (32 * max_len + 1)]}, "prompt", "--max-prompt-chars"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 4097},
         "messages", "--max-messages"),
    ]
    for path, body, param, limit in cases:
        response = tiny_server.post(path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and limit in error["message"], error
    under = tiny_server.chat("x" * (32 * max_len - 200), max_tokens=2)  # tokenised, too long
    assert under.json()["error"]["message"].startswith("Context size has been exceeded.")
    assert tiny_server.chat("still serving", **GREEDY).status_code == 200


def test_openai_client_with_harmless_fields_set(tiny_server):
    out = client(tiny_server).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        presence_penalty=0, frequency_penalty=0, logprobs=False, user="u-1", store=False,
        metadata={"k": "v"}, service_tier="auto", response_format={"type": "text"},
        prompt_cache_key="k", safety_identifier="s", stream_options=None)
    assert out.usage.completion_tokens <= 3
    with pytest.raises(openai.BadRequestError, match="'functions' is not supported"):
        client(tiny_server).chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            functions=[{"name": "f", "parameters": {"type": "object"}}])
