"""Sampling fields over real HTTP with the real `openai` client and the real model: logprobs in
OpenAI's and llama.cpp's shapes (whole and streamed), penalties, logit_bias, min_tokens, bad
values, and penalty state across swap and recompute parks."""

import concurrent.futures as cf

import openai
import pytest
from serverproc import ServerProcess

CHAT_MSG = [{"role": "user", "content": "What is the capital of France?"}]
REPEATING = "one, two, one, two, one, two,"  # greedy continues it with many repeated tokens


def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def tokens(server, prompt, n, **extra):
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
            "return_tokens": True, **extra}
    response = server.post("/completion", body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def num_repeats(ids):
    return len(ids) - len(set(ids))


def test_chat_logprobs_describe_the_greedy_text(smollm2_server):
    out = client(smollm2_server).chat.completions.create(
        model="m", messages=CHAT_MSG, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3)
    choice = out.choices[0]
    entries = choice.logprobs.content  # one per token of the text (an ending EOS is not text)
    assert len(entries) == out.usage.completion_tokens == 5
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert bytes(e.bytes) == e.token.encode() and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
        # greedy: the sampled token is the most likely one
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    assert sum(e.logprob for e in entries) < 0


def test_streamed_chat_logprobs_are_the_whole_ones_chunk_by_chunk(smollm2_server):
    """A stop string holds text back: the chunks' logprobs still add up to the whole list, and
    a chunk's logprobs are those of the tokens sampled since the previous chunk."""
    params = dict(model="m", messages=CHAT_MSG, max_tokens=16, temperature=0, logprobs=True,
                  top_logprobs=1, stop=["Paris is"])
    whole = client(smollm2_server).chat.completions.create(**params)
    streamed, texts = [], []
    for chunk in client(smollm2_server).chat.completions.create(stream=True, **params):
        for choice in chunk.choices:
            if choice.delta.content:
                texts.append(choice.delta.content)
                assert choice.logprobs is not None and choice.logprobs.content
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    assert "".join(texts) == whole.choices[0].message.content
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content]


def test_completion_logprobs_in_openai_shape_whole_and_streamed(smollm2_server):
    params = dict(model="m", prompt="The capital of France is", max_tokens=6, temperature=0,
                  logprobs=2)
    whole = client(smollm2_server).completions.create(**params).choices[0]
    lp = whole.logprobs
    assert "".join(lp.tokens) == whole.text and len(lp.token_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == logprob == max(top.values())
    chunks = [c.choices[0] for c in client(smollm2_server).completions.create(
        stream=True, **params) if c.choices]
    got = [(t, o) for c in chunks if c.logprobs for t, o in zip(c.logprobs.tokens,
                                                                 c.logprobs.text_offset)]
    assert got == list(zip(lp.tokens, lp.text_offset))


def test_llama_n_probs_gives_completion_probabilities(smollm2_server):
    body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0,
            "n_probs": 3, "return_tokens": True}
    out = smollm2_server.post("/completion", body).json()
    probs = out["completion_probabilities"]
    assert [p["id"] for p in probs] == out["tokens"]
    assert "".join(p["token"] for p in probs) == out["content"]
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]
               for p in probs)


DIRECTIONS = [  # (penalty, whether it leaves fewer repeated tokens than no penalty)
    ({"frequency_penalty": 2.0}, True), ({"presence_penalty": 2.0}, True),
    ({"repetition_penalty": 1.5}, True), ({"repeat_penalty": 1.5}, True),
    # -2, not -1: at -1 this model's greedy text only turns from one count to another
    # ("..., nine, 10, 11" to "..., nine, 1, 2": 17 repeats against 19 with the AMX prompt rows)
    ({"frequency_penalty": -2.0}, False), ({"repetition_penalty": 0.7}, False),
]


@pytest.fixture(scope="module")
def penalised(smollm2_server):
    """Greedy tokens without a penalty and with each of DIRECTIONS, side by side in one batch
    (greedy output does not depend on the batch)."""
    bodies = [{}] + [extra for extra, _ in DIRECTIONS]
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda extra: tokens(smollm2_server, REPEATING, 32, **extra),
                             bodies))


@pytest.mark.parametrize("case", range(len(DIRECTIONS)))
def test_each_penalty_moves_greedy_repetition_the_expected_way(penalised, case):
    base, got = num_repeats(penalised[0]), num_repeats(penalised[case + 1])
    assert got < base if DIRECTIONS[case][1] else got > base


def test_repeat_last_n_zero_turns_repeat_penalty_off(smollm2_server):
    base = tokens(smollm2_server, REPEATING, 12)
    assert tokens(smollm2_server, REPEATING, 12, repeat_penalty=1.5, repeat_last_n=0) == base


def test_logit_bias_bans_and_forces_tokens(smollm2_server):
    base = tokens(smollm2_server, "The capital of France is", 6)
    banned = tokens(smollm2_server, "The capital of France is", 6,
                    logit_bias={str(base[0]): -100})
    assert banned[0] != base[0] and base[0] not in banned
    forced = base[2]  # llama.cpp's list form
    assert tokens(smollm2_server, "The capital of France is", 4,
                  logit_bias=[[forced, 100]]) == [forced] * 4
    out = client(smollm2_server).chat.completions.create(
        model="m", messages=CHAT_MSG, max_tokens=3, temperature=0,
        logit_bias={str(forced): 100}, logprobs=True)
    assert len(out.choices[0].logprobs.content) == 3


def test_min_tokens_keeps_eos_and_stop_strings_from_ending_early(smollm2_server):
    c = client(smollm2_server)
    short = c.chat.completions.create(model="m", messages=CHAT_MSG, max_tokens=40,
                                      temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 30
    longer = c.chat.completions.create(model="m", messages=CHAT_MSG, max_tokens=40,
                                       temperature=0, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    assert longer.choices[0].message.content.startswith(short.choices[0].message.content)
    stop = short.choices[0].message.content.split()[1]  # a word near the start
    early = c.chat.completions.create(model="m", messages=CHAT_MSG, max_tokens=40,
                                      temperature=0, stop=[stop])
    held = c.chat.completions.create(model="m", messages=CHAT_MSG, max_tokens=40,
                                     temperature=0, stop=[stop], extra_body={"min_tokens": 8})
    assert early.usage.completion_tokens < 8 <= held.usage.completion_tokens


@pytest.mark.parametrize("extra,param", [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
])
def test_bad_values_are_a_400_naming_the_field(smollm2_server, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client(smollm2_server).chat.completions.create(
            model="m", messages=CHAT_MSG, max_tokens=2, extra_body=extra)
    assert exc.value.body["param"] == param
    ok = client(smollm2_server).chat.completions.create(model="m", messages=CHAT_MSG,
                                                        max_tokens=2)
    assert ok.choices[0].message.content


PENALTIES = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3,
             "repeat_penalty": 1.2, "repeat_last_n": 16}


@pytest.mark.parametrize("flags,mode", [([], "swap"), (["--preempt-ram", "0"], "recompute")])
def test_penalty_state_survives_parks(tiny_server, flags, mode):
    """Penalties count `seq.tokens`, which parks keep: a request parked every 8 tokens (4 times),
    by swap or by recompute, gives the same greedy tokens as one never parked."""
    prompt = "penalties across parks " * 3
    plain = tokens(tiny_server, prompt, 40)
    expected = tokens(tiny_server, prompt, 40, **PENALTIES)
    assert expected != plain  # the penalties do change this output
    with ServerProcess(["-np", "4", "-c", "2048", "--preempt-every", "8", *flags]) as server:
        assert tokens(server, prompt, 40, **PENALTIES) == expected
        m = server.metrics()
    assert m["kvpark:n_preempt_total"] >= 4
    assert m[f"kvpark:n_preempt_{mode}_total"] == m["kvpark:n_preempt_total"]
