"""The endpoints clients call besides chat: batched completions, tokenize/detokenize, model
cards, /props, paths without /v1, CORS, JSON 404/405, embeddings, and the operator's view
(metrics aliases, quiet health polls, load log, a missing model path)."""

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from serverproc import ServerProcess, parse_metrics

SMOLLM2 = "SmolLM2-135M-Instruct"
ORIGIN = "https://ui.example"


@pytest.fixture(scope="module")
def named_server():
    """Two served names and one CORS origin, on the tiny model."""
    flags = ["-np", "2", "-c", "1024", "--served-model-name", "kv-a,kv-b",
             "--cors-origin", ORIGIN]
    with ServerProcess(flags) as server:
        yield server


def client(server: ServerProcess, path: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + path, api_key="none", max_retries=0)


def test_batched_prompts_are_choices_in_openai_order(smollm2_server):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    batch = client(smollm2_server).completions.create(
        model=SMOLLM2, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        alone = client(smollm2_server).completions.create(
            model=SMOLLM2, prompt=prompt, max_tokens=5, temperature=0)
        assert batch.choices[2 * p].text == batch.choices[2 * p + 1].text == alone.choices[0].text
    lengths = [len(smollm2_server.post("/tokenize", {"content": p}).json()["tokens"])
               for p in prompts]
    assert batch.usage.prompt_tokens == sum(lengths)
    assert 0 < batch.usage.completion_tokens <= 6 * 5
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_batched_token_id_prompts_stream(smollm2_server):
    ids = [smollm2_server.post("/tokenize", {"content": t}).json()["tokens"]
           for t in ("Once upon a time", "The sky is")]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client(smollm2_server).completions.create(
            model=SMOLLM2, prompt=ids, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    for i, prompt in enumerate(ids):
        alone = client(smollm2_server).completions.create(
            model=SMOLLM2, prompt=prompt, max_tokens=6, temperature=0)
        assert texts[i] == alone.choices[0].text


@pytest.mark.parametrize("prompt, param", [
    (["ok"] * 65, "prompt"),
    (["ok", ""], "prompt[1]"),
    ([[1, 2], [-5]], "prompt[1]"),
    (["ok", "x " * 5000], "prompt[1]"),  # longer than the pool
])
def test_bad_batches_name_the_prompt(smollm2_server, prompt, param):
    response = smollm2_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_tokenize_detokenize_round_trip(smollm2_server):
    text = "Héllo wörld 🦙 <|im_start|>"
    ids = smollm2_server.post("/tokenize", {"content": text}).json()["tokens"]
    assert all(isinstance(i, int) for i in ids) and len(ids) > 5
    # llama.cpp reads `content`, vLLM `prompt`
    assert smollm2_server.post("/detokenize", {"tokens": ids}).json() == {"content": text,
                                                                          "prompt": text}
    pieces = smollm2_server.post("/tokenize", {"content": text, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == ids
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list)
                      else p["piece"].encode() for p in pieces["tokens"])
    assert joined.decode() == text  # a piece that splits a character comes as its bytes
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])
    bad = smollm2_server.post("/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert smollm2_server.post("/tokenize", {"text": "x"}).json()["error"]["param"] == "content"


def test_several_prompts_in_one_llama_completion_answer_as_each_alone(smollm2_server):
    """llama-server's /completion with a list of prompts: a list of results in their order,
    each what the prompt alone gets (greedy); a stream's chunks say their index."""
    prompts = ["The capital of France is", [504, 3458, 282]]
    body = {"n_predict": 6, "temperature": 0}
    alone = [smollm2_server.post("/completion", {**body, "prompt": p}).json() for p in prompts]
    together = smollm2_server.post("/completion", {**body, "prompt": prompts}).json()
    assert [r["index"] for r in together] == [0, 1]
    assert [r["content"] for r in together] == [r["content"] for r in alone]
    streamed = {0: "", 1: ""}
    with httpx.stream("POST", f"{smollm2_server.url}/completion",
                      json={**body, "prompt": prompts, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                streamed[chunk["index"]] += chunk["content"]
    assert [streamed[0], streamed[1]] == [r["content"] for r in alone]


def test_chat_echo_puts_the_last_assistant_message_before_the_reply(smollm2_server):
    """vLLM's chat `echo`: the continued assistant message comes back in front."""
    messages = [{"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "A fruit:"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    plain = smollm2_server.post("/v1/chat/completions", body).json()
    echoed = smollm2_server.post("/v1/chat/completions", {**body, "echo": True}).json()
    reply = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "A fruit:" + reply
    chunks = []
    with httpx.stream("POST", f"{smollm2_server.url}/v1/chat/completions",
                      json={**body, "echo": True, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"])
    text = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    assert text == "A fruit:" + reply


def test_tokenizer_info_is_what_the_other_endpoints_use(smollm2_server):
    """vLLM's /tokenizer_info, which lm-evaluation-harness's remote tokenizer reads first:
    the special tokens are the texts /detokenize gives their ids, the template /props'."""
    info = httpx.get(f"{smollm2_server.url}/tokenizer_info").json()
    props = httpx.get(f"{smollm2_server.url}/props").json()
    assert info["chat_template"] == props["chat_template"]
    assert info["model_max_length"] == props["default_generation_settings"]["n_ctx"] * 4
    eos = smollm2_server.post("/tokenize", {"content": info["eos_token"]}).json()["tokens"]
    assert len(eos) == 1 and info["eos_token"] == "<|im_end|>"
    assert info["tokenizer_class"] and info["add_bos_token"] is False


def test_models_without_v1_and_props(smollm2_server):
    models = client(smollm2_server, "").models.list()
    assert [m.id for m in models.data] == [SMOLLM2]
    assert client(smollm2_server).models.retrieve(SMOLLM2).id == SMOLLM2
    with pytest.raises(openai.NotFoundError) as missing:
        client(smollm2_server).models.retrieve("gpt-4o")
    assert missing.value.body["param"] == "model"
    chat = client(smollm2_server, "").chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.object == "chat.completion" and chat.choices[0].message.content
    props = httpx.get(f"{smollm2_server.url}/props").json()
    assert props["total_slots"] == 4
    assert props["model_path"].endswith(".gguf")
    assert "<|im_start|>" in props["chat_template"]
    assert props["default_generation_settings"]["n_ctx"] == 1024
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["build_info"].startswith("kvpark ")


def test_unknown_paths_and_methods_are_json(smollm2_server):
    missing = httpx.get(f"{smollm2_server.url}/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = httpx.get(f"{smollm2_server.url}/v1/chat/completions")
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"]["message"]


def test_embeddings_are_refused_clearly(smollm2_server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(smollm2_server).embeddings.create(model=SMOLLM2, input="hi")
    assert "does not support Embeddings" in refused.value.message


def test_served_names_and_cors(named_server):
    assert [m.id for m in client(named_server).models.list().data] == ["kv-a", "kv-b"]
    assert client(named_server).models.retrieve("kv-b").id == "kv-b"
    # another model name is still served, as llama-server does; the echo is the first name
    done = client(named_server).completions.create(model="other", prompt="hi", max_tokens=2)
    assert done.model == "kv-a"
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{named_server.url}/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{named_server.url}/v1/chat/completions",
                          headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    plain = httpx.get(f"{named_server.url}/v1/models", headers={"Origin": ORIGIN})
    assert plain.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_headers_by_default(smollm2_server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    response = httpx.options(f"{smollm2_server.url}/v1/chat/completions", headers=preflight)
    assert response.status_code == 405 and "access-control-allow-origin" not in response.headers


def test_metrics_aliases_and_latency_histograms(named_server):
    client(named_server).completions.create(model="kv-a", prompt="hi", max_tokens=4,
                                            extra_body={"ignore_eos": True})
    text = httpx.get(f"{named_server.url}/metrics").text
    values = parse_metrics(text)
    label = '{model_name="kv-a"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert f"{name}{label}" in values
    assert 0 <= values[f"vllm:kv_cache_usage_perc{label}"] <= 1
    assert values[f"vllm:time_to_first_token_seconds_count{label}"] >= 1
    assert values[f"vllm:inter_token_latency_seconds_count{label}"] >= 3
    assert values["kvpark:inter_token_latency_seconds_count"] >= 3
    assert values["kvpark:time_to_first_token_seconds_count"] >= 1
    assert values[f"vllm:generation_tokens_total{label}"] >= 4
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="kv-a"}' in values
    assert "kvpark:requests_processing" in values  # the kvpark names stay
    assert "_created" not in text


def test_health_polls_are_not_logged_and_load_is(named_server):
    httpx.get(f"{named_server.url}/health")
    client(named_server).models.list()
    log = named_server.log()
    assert '"GET /v1/models HTTP/1.1" 200' in log  # the access log is on
    assert "GET /health" not in log and "GET /metrics" not in log
    assert "model loaded in" in log and "attention backend" in log


def test_a_missing_model_path_is_one_line():
    model = "/nonexistent/model.gguf"
    done = subprocess.run([sys.executable, "-m", "kvpark.pod", "-m", model],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and model in lines[0] and "Traceback" not in done.stderr


def test_amx_on_where_amx_does_not_run_is_one_line_and_exit_2():
    """`KVPARK_MAX_CPU_ISA=avx2` takes AMX away on any CPU: `--amx on` then refuses to start."""
    done = subprocess.run([sys.executable, "-m", "kvpark.pod", "-m", "synthetic:tiny",
                           "--amx", "on", "--port", "1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "KVPARK_MAX_CPU_ISA": "avx2"})
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    [line] = [x for x in output.splitlines() if "--amx on" in x and "ServerArgs" not in x]
    assert "AMX does not run here" in line
