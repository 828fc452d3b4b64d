"""Prompt logprobs over real HTTP: completions' `echo` with `logprobs` (how lm-evaluation-harness
scores log-likelihoods) and vLLM's `prompt_logprobs`, checked against a direct forward pass of
SmolLM2 and, bit for bit, against the logprobs decode gave the same tokens."""

import json
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serverproc import ServerProcess

from kvpark.kernels import amx_gemm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_llama import builtin_model, reference_logits  # noqa: E402

TEXT = "The capital of France is Paris. The capital of Germany is"
# How far a logprob may be from the float64 reference: float32 linears' sums round differently;
# where AMX runs the prompt rows' products are bf16 (`--amx auto`; on this text and the two
# continuations below measured at most 0.057 off, 0.047 for the top token)
REFERENCE_TOLERANCE = 0.12 if amx_gemm.usable() else 2e-3


def tokenize(server, text):
    return httpx.post(f"{server.url}/tokenize", json={"content": text}, timeout=30).json()["tokens"]


def scored(server, prompt, k=1, **extra):
    body = {"prompt": prompt, "echo": True, "logprobs": k, "max_tokens": 0, **extra}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_echo_logprobs_are_the_models_own_over_the_prompt(smollm2_server):
    """Each prompt token's logprob is log_softmax of a plain forward pass (no KV cache, fp32) at
    the position before it; the tops are the model's most likely tokens there."""
    ids = tokenize(smollm2_server, TEXT)
    choice = scored(smollm2_server, ids, k=3)
    logprobs = choice["logprobs"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == TEXT
    expected = torch.log_softmax(reference_logits(builtin_model(), ids).double(), -1)
    for pos in range(1, len(ids)):
        want = float(expected[pos - 1, ids[pos]])
        assert logprobs["token_logprobs"][pos] == pytest.approx(want, abs=REFERENCE_TOLERANCE), pos
        best = int(expected[pos - 1].argmax())
        top = logprobs["top_logprobs"][pos]
        assert max(top.values()) == pytest.approx(float(expected[pos - 1, best]),
                                              abs=REFERENCE_TOLERANCE)
    # " Berlin" is what the model expects next: a far better score than a wrong city
    good = scored(smollm2_server, ids + tokenize(smollm2_server, " Berlin"))
    bad = scored(smollm2_server, ids + tokenize(smollm2_server, " Madrid"))
    assert good["logprobs"]["token_logprobs"][-1] > bad["logprobs"]["token_logprobs"][-1] + 1


def test_prompt_rows_give_the_bits_decode_gave(tiny_server):
    """The same tokens scored as a prompt get exactly the logprobs decode gave them: on the CPU
    with float32 linears and batch invariance a row's bits do not depend on its neighbours."""
    prompt = tokenize(tiny_server, TEXT)
    made = tiny_server.post("/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0,
                                            "ignore_eos": True, "n_probs": 1,
                                            "return_tokens": True}).json()
    generated = made["tokens"]
    decoded = [entry["logprob"] for entry in made["completion_probabilities"]]
    echoed = scored(tiny_server, prompt + generated)["logprobs"]["token_logprobs"]
    assert echoed[len(prompt):] == decoded


def test_a_recompute_replay_records_prompt_logprobs_once():
    """Parked and replayed after every 2 tokens: the prompt's rows run again, their logprobs
    are neither doubled nor changed."""
    with ServerProcess(["-np", "1", "-c", "512", "--preempt-every", "2",
                        "--preempt-ram", "0"]) as server:
        prompt = tokenize(server, TEXT)
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "prompt_logprobs": 2}
        parked = server.post("/v1/completions", body).json()
        assert server.metric("kvpark:n_preempt_recompute_total") >= 2
    with ServerProcess(["-np", "1", "-c", "512", "--no-preempt"]) as plain:
        unparked = plain.post("/v1/completions", body).json()
    got = parked["choices"][0]["prompt_logprobs"]
    assert len(got) == len(prompt) and got == unparked["choices"][0]["prompt_logprobs"]
    assert parked["choices"][0]["text"] == unparked["choices"][0]["text"]


def test_vllms_prompt_logprobs_on_completions_and_chat(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="m", prompt=TEXT, max_tokens=2,
                                    extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out.usage.prompt_tokens
    ids = tokenize(tiny_server, TEXT)
    for pos, entry in enumerate(entries[1:], start=1):
        assert str(ids[pos]) in entry  # the prompt's own token, with its rank
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] or ranks == [1]
        by_rank = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["logprob"] for e in by_rank] == sorted((e["logprob"] for e in by_rank),
                                                           reverse=True)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    listed = chat.model_extra["prompt_logprobs"]
    assert listed[0] is None and len(listed) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in listed[1:])


def test_echo_streams_the_prompt_first_and_matches_the_whole_answer(tiny_server):
    body = {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    whole = tiny_server.post("/v1/completions", body).json()["choices"][0]
    chunks = []
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"].startswith(TEXT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_echo_of_a_batch_echoes_each_prompt(tiny_server):
    out = tiny_server.post("/v1/completions", {"prompt": ["One two", "Three"], "echo": True,
                                               "max_tokens": 0, "logprobs": 0}).json()
    texts = sorted(c["text"] for c in out["choices"])
    assert texts == ["One two", "Three"]
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in out["choices"])


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),  # zero tokens only scores a prompt with echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_echo_fields_are_400s(tiny_server, body, param):
    response = tiny_server.post("/v1/completions", {"prompt": TEXT, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_prompt_in_many_chunks_gets_the_same_prompt_logprobs(tiny_server):
    """Prefilled 16 tokens a step (and with another request beside it), each row's logprobs are
    recorded once, at its place, with the bits of a one-chunk prefill."""
    body = {"prompt": TEXT * 4, "max_tokens": 1, "prompt_logprobs": 1}
    whole = tiny_server.post("/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
    with ServerProcess(["-np", "2", "-c", "1024", "-b", "16"]) as chunked:
        beside = chunked.post("/v1/completions", {**body, "prompt": TEXT, "n": 2})
        assert beside.status_code == 200
        assert chunked.post("/v1/completions", body).json()["choices"][0][
            "prompt_logprobs"] == whole
    assert len(whole) >= 16 * 3  # three chunks or more


def test_edge_cases_one_token_prompts_and_streamed_echo_without_output(tiny_server):
    one = tiny_server.post("/v1/completions", {"prompt": [42], "max_tokens": 1,
                                               "prompt_logprobs": 3}).json()
    assert one["choices"][0]["prompt_logprobs"] == [None]
    chunks = []
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json={
            "prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 0, "stream": True},
            timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert "".join(c["text"] for c in chunks) == TEXT
    assert chunks[-1]["finish_reason"] == "length"
