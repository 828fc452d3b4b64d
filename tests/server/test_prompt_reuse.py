"""The prefix cache over real HTTP: a later turn computes only what is new, the usage fields
say so, the cache never changes an output, and a parked sequence comes back from it."""

import json

import httpx
import pytest
from serverproc import ServerProcess

PS = 16  # the default --page-size
GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}


def complete(server, prompt, n_predict, **extra) -> dict:
    response = server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY,
                                           **extra})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def cache_server():
    with ServerProcess(["-np", "2", "-c", "4096"]) as server:
        yield server


def test_a_second_turn_computes_only_the_new_tokens(cache_server):
    turn1 = list(range(1000, 1100))
    first = complete(cache_server, turn1, 40)
    assert first["timings"]["cache_n"] == 0
    hits = cache_server.metric("kvpark:prefix_cache_hits_total")
    history = turn1 + first["tokens"]
    new = list(range(2000, 2060))
    body = {"prompt": history + new, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    second = cache_server.post("/v1/completions", body).json()["usage"]
    # turn 1 computed its prompt and all but its last sampled token
    cached = (len(history) - 1) // PS * PS
    assert second["prompt_tokens_details"]["cached_tokens"] == cached
    assert second["prompt_tokens"] - cached <= len(new) + PS  # the new turn, and one page
    assert cache_server.metric("kvpark:prefix_cache_hits_total") - hits == cached
    assert cache_server.metric("kvpark:kv_cache_pages_cached") > 0


def test_chat_reports_cached_tokens_also_in_the_streamed_usage(cache_server):
    messages = [{"role": "user", "content": "remember the word lighthouse " * 8}]
    one = cache_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 12,
                                                     "temperature": 0}).json()
    answer = one["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "which word was it?"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cache_server.url}/v1/chat/completions", json=body,
                      timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    first_prompt = one["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (first_prompt - 1) // PS * PS > 0


def test_forced_swap_parks_come_back_from_the_cache_without_a_replay(cache_server):
    prompt = "a prompt that is parked and resumed every sixteen tokens " * 2
    expected = complete(cache_server, prompt, 100)
    with ServerProcess(["-np", "2", "-c", "4096"], env={"KVPARK_PREEMPT_EVERY": "16"}) as server:
        got = complete(server, prompt, 100)
        m = server.metrics()
    assert got["tokens"] == expected["tokens"]
    assert got["content"].encode() == expected["content"].encode()
    assert m["kvpark:n_preempt_total"] >= 5
    assert m["kvpark:n_preempt_cached_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:n_recompute_tokens_total"] == 0


def test_without_the_cache_nothing_is_cached():
    with ServerProcess(["-np", "1", "-c", "1024", "--no-prefix-cache"]) as server:
        for _ in range(2):
            done = complete(server, list(range(1000, 1064)), 4)
        assert done["timings"]["cache_n"] == 0
        m = server.metrics()
        assert "prefix cache off" in server.log()
    assert m["kvpark:prefix_cache_hits_total"] == 0 and m["kvpark:kv_cache_pages_cached"] == 0


# ---- the real model: the cache never changes an output ---------------------------------------
TURNS = ["The history of bread begins", " Then the Romans", " Later, in the middle ages,"]


def conversation(server, repeat_last: bool = True) -> list[dict]:
    """Three turns, each re-sending the whole history plus a new sentence; and (`repeat_last`)
    the last turn's prompt sent once more (every full page of it cached)."""
    history = ""
    turns = []
    for text in TURNS:
        history += text
        turn = complete(server, history, 24)
        turns.append(turn)
        last, history = history, history + turn["content"]
    return [*turns, complete(server, last, 24)] if repeat_last else turns


def test_greedy_output_is_identical_with_the_cache_on_and_off(smollm2_server):
    """Decode rows read the GGUF's blocks here: generated pages are keyed apart (split_kinds),
    so the later turns reuse the earlier prompts."""
    with_cache = conversation(smollm2_server)
    with ServerProcess(["-np", "4", "-c", "4096", "--no-prefix-cache", "--weights", "gguf"],
                       model="builtin://smollm2-135m") as server:
        without = conversation(server)
    assert with_cache[-1]["timings"]["cache_n"] >= PS
    for on, off in zip(with_cache, without):
        assert on["tokens"] == off["tokens"]
        assert on["content"].encode() == off["content"].encode()


def test_fp32_rows_reuse_decoded_pages_and_stay_identical():
    """With float32 linears for every row a page decoded in one turn is the next turn's
    prompt page, bit for bit (batch-invariant CPU kernels)."""
    outputs = []
    for flags in ([], ["--no-prefix-cache"]):
        with ServerProcess(["-np", "2", "-c", "2048", "--weights", "fp32", *flags],
                           model="builtin://smollm2-135m") as server:
            outputs.append(conversation(server, repeat_last=False))  # turn 1 holds the check
    on, off = outputs
    assert on[1]["timings"]["cache_n"] >= PS  # a page of turn 1 holding decoded tokens
    for a, b in zip(on, off):
        assert a["tokens"] == b["tokens"] and a["content"].encode() == b["content"].encode()
