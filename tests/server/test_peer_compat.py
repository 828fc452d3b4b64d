"""What llama.cpp and vLLM users reach for (issue 27), over real HTTP with real clients:
server-wide sampling defaults; the names their clients and dashboards read
(system_fingerprint, llamacpp: metrics, the context-overflow error, one-token timings)."""

import json
import subprocess
import sys

import httpx
import openai
import pytest
from serverproc import ServerProcess

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def defaults_server(tmp_path_factory):
    """Defaults from all three sources: the generation config gives top_p, the override the
    temperature (greedy), the flags max_tokens and the seed."""
    config_dir = tmp_path_factory.mktemp("genconfig")
    (config_dir / "generation_config.json").write_text(json.dumps(
        {"top_p": 0.5, "temperature": 0.9, "max_new_tokens": 9}))
    flags = ["-np", "2", "-c", "1024", "--generation-config", str(config_dir),
             "--override-generation-config", '{"temperature": 0, "max_new_tokens": 6}',
             "-n", "4", "--seed", "1234", "--repeat-last-n", "16"]
    with ServerProcess(flags) as server:
        yield server


def completion(server, **fields):
    response = server.post("/v1/completions", {"prompt": PROMPT, "ignore_eos": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_props_show_the_servers_defaults(defaults_server):
    props = httpx.get(f"{defaults_server.url}/props", timeout=10).json()
    params = props["default_generation_settings"]["params"]
    assert params["temperature"] == 0 and params["top_p"] == 0.5
    assert params["n_predict"] == 4 and params["seed"] == 1234
    assert params["repeat_last_n"] == 16


def test_a_request_that_sets_nothing_gets_the_defaults(defaults_server, tiny_server):
    answer = completion(defaults_server)
    assert answer["usage"]["completion_tokens"] == 4  # -n 4
    # greedy (the override's temperature 0): the text of a plain greedy request elsewhere
    greedy = completion(tiny_server, temperature=0, max_tokens=4)
    assert answer["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_a_requests_own_fields_win(defaults_server, tiny_server):
    answer = completion(defaults_server, max_tokens=7, temperature=1.0, top_p=1.0, seed=7)
    assert answer["usage"]["completion_tokens"] == 7
    same = completion(tiny_server, max_tokens=7, temperature=1.0, top_p=1.0, seed=7)
    assert answer["choices"][0]["text"] == same["choices"][0]["text"]
    chat = defaults_server.chat("hi", max_completion_tokens=2, ignore_eos=True)
    assert chat.json()["usage"]["completion_tokens"] == 2
    llama = defaults_server.post("/completion", {"prompt": PROMPT, "n_predict": 3,
                                                 "ignore_eos": True})
    assert llama.json()["tokens_predicted"] == 3


def test_the_default_seed_makes_sampled_answers_repeat(defaults_server):
    first = completion(defaults_server, temperature=1.0, top_p=1.0)
    again = completion(defaults_server, temperature=1.0, top_p=1.0)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]


@pytest.mark.parametrize("flags, said", [
    (["--temp", "5"], "sampling default from flag: 'temperature': must be between 0.0 and 2.0"),
    (["--override-generation-config", '{"top_q": 1}'], "unknown key(s) top_q"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}'],
     "--kv-events-config: unknown key(s) bogus"),
])
def test_a_bad_default_stops_the_server_with_the_reason(flags, said):
    done = subprocess.run(
        [sys.executable, "-m", "kvpark.pod", "-m", "synthetic:tiny", "--port", "0", *flags],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert said in done.stdout + done.stderr


def test_system_fingerprint_in_answers_and_chunks(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)
    ask = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="m", messages=ask, max_tokens=3)
    assert whole.system_fingerprint.startswith("fp_") and len(whole.system_fingerprint) == 13
    chunks = list(client.chat.completions.create(model="m", messages=ask, max_tokens=3,
                                                 stream=True))
    assert {c.system_fingerprint for c in chunks} == {whole.system_fingerprint}
    text = client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert text.system_fingerprint == whole.system_fingerprint


def test_a_fingerprint_changes_with_what_decides_the_numbers(tiny_server):
    """A float32-linears server of the same model computes other bits: another fingerprint."""
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ours = tiny_server.post("/v1/chat/completions", ask).json()["system_fingerprint"]
    with ServerProcess(["-np", "1", "-c", "256", "--no-batch-invariant"]) as other:
        theirs = other.post("/v1/chat/completions", ask).json()["system_fingerprint"]
    assert theirs != ours


def test_llama_servers_metric_names(tiny_server):
    before = tiny_server.metrics()
    answer = completion(tiny_server, max_tokens=5, temperature=0)
    after = tiny_server.metrics()
    grew = after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"]
    assert grew == answer["usage"]["completion_tokens"] == 5
    assert (after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
            == answer["usage"]["prompt_tokens"])
    assert after["llamacpp:n_decode_total"] >= before["llamacpp:n_decode_total"] + 5
    assert after["llamacpp:prompt_seconds_total"] > before["llamacpp:prompt_seconds_total"]
    assert after["llamacpp:predicted_tokens_seconds"] > 0
    for gauge in ("requests_processing", "requests_deferred", "kv_cache_usage_ratio",
                  "kv_cache_tokens", "n_busy_slots_per_decode", "prompt_tokens_seconds"):
        assert f"llamacpp:{gauge}" in after


def test_a_prompt_past_the_context_has_llama_cpps_error_type_and_numbers(defaults_server):
    response = defaults_server.post("/completion", {"prompt": list(range(1, 2000))})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_prompt_tokens"] == 1999 and error["n_ctx"] == 1024
    assert error["message"].startswith("Context size has been exceeded.")


def test_one_token_answers_report_no_generation_rate(tiny_server):
    answer = tiny_server.post("/completion", {"prompt": PROMPT, "n_predict": 1,
                                              "ignore_eos": True}).json()
    assert answer["timings"]["predicted_n"] == 1
    assert answer["timings"]["predicted_per_second"] == 0.0
    two = tiny_server.post("/completion", {"prompt": PROMPT, "n_predict": 2,
                                           "ignore_eos": True}).json()
    assert two["timings"]["predicted_per_second"] > 0


CHAT = [{"role": "user", "content": "Name a colour."}]
PREFILL = [*CHAT, {"role": "assistant", "content": "My favourite colour is"}]


def rendered(server, **body):
    response = server.post("/apply-template", body)
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


def test_apply_template_renders_what_a_chat_request_runs(smollm2_server):
    text = rendered(smollm2_server, messages=CHAT)
    assert text.endswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm2_server.post("/tokenize", {"messages": CHAT}).json()
    chat = smollm2_server.chat("Name a colour.", max_tokens=1).json()
    assert ids["count"] == len(ids["tokens"]) == chat["usage"]["prompt_tokens"]
    assert ids["max_model_len"] > 0
    # vLLM's prompt form and llama.cpp's content form: the same ids for the same text
    by_prompt = smollm2_server.post("/tokenize", {"prompt": text}).json()["tokens"]
    assert by_prompt == smollm2_server.post("/tokenize", {"content": text}).json()["tokens"]
    back = smollm2_server.post("/detokenize", {"tokens": by_prompt}).json()
    assert back["prompt"] == back["content"] == text


def test_a_trailing_assistant_message_is_continued_as_llama_cpp_does(smollm2_server):
    """The last assistant turn is left open: the rendered prompt ends in its text, and the
    answer continues it (the same tokens as a raw completion of that prompt)."""
    text = rendered(smollm2_server, messages=PREFILL)
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    greedy = {"max_tokens": 8, "temperature": 0}
    chat = smollm2_server.post("/v1/chat/completions", {"messages": PREFILL, **greedy}).json()
    raw = smollm2_server.post("/v1/completions", {"prompt": text, **greedy}).json()
    assert chat["choices"][0]["message"]["content"] == raw["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    vllm = smollm2_server.post("/v1/chat/completions", {
        "messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False,
        **greedy}).json()
    assert vllm["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]


def test_add_generation_prompt_picks_a_new_turn_or_none(smollm2_server):
    new_turn = rendered(smollm2_server, messages=PREFILL, add_generation_prompt=True)
    assert new_turn.endswith("My favourite colour is<|im_end|>\n<|im_start|>assistant\n")
    no_turn = rendered(smollm2_server, messages=CHAT, add_generation_prompt=False)
    assert no_turn.endswith("Name a colour.<|im_end|>\n")


@pytest.mark.parametrize("body, param, words", [
    ({"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "Cannot set both"),
    ({"messages": CHAT, "continue_final_message": True}, "continue_final_message",
     "assistant"),
    ({"messages": [*PREFILL, {"role": "assistant", "content": "x"}]}, "messages",
     "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": CHAT, "add_generation_prompt": "yes"}, "add_generation_prompt", "true or"),
])
def test_conflicting_prefill_fields_are_400s(tiny_server, body, param, words):
    for path in ("/v1/chat/completions", "/apply-template"):
        response = tiny_server.post(path, {**body, "max_tokens": 2})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and words in response.text


def test_version(tiny_server):
    assert httpx.get(f"{tiny_server.url}/version", timeout=10).json()["version"]


def sse_chunks(server, path, body):
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


LONG = "one two three four five " * 160  # ~800 tokens: more than one 512-token chunk


def test_return_progress_reports_each_prompt_chunk_before_the_text(tiny_server):
    chunks = sse_chunks(tiny_server, "/completion", {"prompt": LONG, "n_predict": 2,
                                                     "return_progress": True,
                                                     "ignore_eos": True})
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    first_text = next(i for i, c in enumerate(chunks) if "prompt_progress" not in c)
    assert chunks[first_text]["content"] and first_text == len(progress)
    total = progress[-1]["total"]
    assert len(progress) >= 2 and progress[-1]["processed"] == total > 512
    processed = [p["processed"] for p in progress]
    assert processed == sorted(processed) and len(set(processed)) == len(processed)
    assert all(p["total"] == total and p["time_ms"] > 0 for p in progress)
    # again: the prefix cache holds its whole pages, and llama.cpp counts them as processed
    again = sse_chunks(tiny_server, "/completion", {"prompt": LONG, "n_predict": 2,
                                                    "return_progress": True})
    cached = [c["prompt_progress"] for c in again if "prompt_progress" in c]
    assert cached[0]["cache"] > 0 and cached[-1]["processed"] == total
    assert all("prompt_progress" not in c for c in sse_chunks(
        tiny_server, "/completion", {"prompt": LONG, "n_predict": 2}))


def test_return_progress_on_a_chat_stream(tiny_server):
    chunks = sse_chunks(tiny_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": LONG}], "max_tokens": 2,
        "return_progress": True})
    progress = [c for c in chunks if "prompt_progress" in c]
    assert progress and all(c["choices"] == [] for c in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]


def test_continuous_usage_stats_in_every_chunk(tiny_server):
    chunks = sse_chunks(tiny_server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "temperature": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == 5
    # each chunk with text counts the tokens sent so far: a token whose bytes are not yet whole
    # text (a sampled byte token) rides with the next one, so steps of one are not promised
    text_counts = [u["completion_tokens"] for c, u in zip(chunks, usages)
                   if c["choices"] and c["choices"][0]["text"]]
    assert text_counts == sorted(set(text_counts)) and len(text_counts) >= 3
    assert {u["prompt_tokens"] for u in usages} == {usages[-1]["prompt_tokens"]}
    plain = sse_chunks(tiny_server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert [c["usage"] for c in plain[:-1]] == [None] * (len(plain) - 1)


def test_completion_answers_carry_llama_cpps_fields(tiny_server):
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    whole = tiny_server.post("/completion", body).json()
    assert len(whole["tokens"]) == 6 and whole["truncated"] is False
    assert whole["has_new_line"] == ("\n" in whole["content"])
    settings = whole["generation_settings"]
    assert settings["n_predict"] == 6 and settings["temperature"] == 0
    assert settings["ignore_eos"] is True and settings["stream"] is False
    chunks = sse_chunks(tiny_server, "/completion", body)
    assert [t for c in chunks for t in c["tokens"]] == whole["tokens"]
    assert chunks[-1]["generation_settings"]["stream"] is True
    assert all(c["id_slot"] is not None for c in chunks)
    without = tiny_server.post("/completion", {**body, "return_tokens": False}).json()
    assert without["tokens"] == []


def test_post_sampling_probs_describe_the_draws_distribution(tiny_server):
    base = {"prompt": PROMPT, "n_predict": 3, "n_probs": 4, "post_sampling_probs": True}
    greedy = tiny_server.post("/completion", {**base, "temperature": 0}).json()
    for entry in greedy["completion_probabilities"]:
        assert entry["prob"] == 1.0 and "logprob" not in entry
        assert [t["id"] for t in entry["top_probs"]] == [entry["id"]]
    sampled = tiny_server.post("/completion", {**base, "temperature": 1.0, "top_k": 3,
                                               "seed": 5}).json()
    for entry in sampled["completion_probabilities"]:
        tops = entry["top_probs"]
        assert len(tops) == 3 and sum(t["prob"] for t in tops) == pytest.approx(1.0, abs=1e-5)
        assert entry["id"] in [t["id"] for t in tops]
    raw = tiny_server.post("/completion", {**base, "post_sampling_probs": False,
                                           "temperature": 0}).json()
    assert "logprob" in raw["completion_probabilities"][0]


def test_logit_bias_keyed_by_text_bans_its_tokens(tiny_server):
    body = {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "return_tokens": True}
    first = tiny_server.post("/completion", body).json()["tokens"][0]
    text = tiny_server.post("/detokenize", {"tokens": [first]}).json()["content"]
    assert tiny_server.post("/tokenize", {"content": text}).json()["tokens"] == [first]
    for bias in ([[text, False]], {text: -100}):
        banned = tiny_server.post("/completion", {**body, "logit_bias": bias}).json()
        assert banned["tokens"][0] != first, bias
    oai = tiny_server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                               "temperature": 0, "logit_bias": {text: -100},
                                               "logprobs": 0}).json()
    assert oai["choices"][0]["text"] != text


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(tiny_server):
    chat = tiny_server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2, "return_tokens_as_token_ids": True, "ignore_eos": True}).json()
    entries = chat["choices"][0]["logprobs"]["content"]
    assert len(entries) == 3
    for entry in entries:
        assert entry["token"].startswith("token_id:") and int(entry["token"][9:]) >= 0
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
    text = tiny_server.post("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "ignore_eos": True,
        "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert all(t.startswith("token_id:") for t in text["logprobs"]["tokens"])
    assert not text["text"].startswith("token_id:")  # the text itself is unchanged
