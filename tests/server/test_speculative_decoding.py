"""Speculative decoding end to end with the real model, by prompt lookup (`--spec-type
ngram-simple`) and by a draft model (`--model-draft`): the output is byte-identical to plain
decoding (greedy and seeded sampling), with parks forced every 16 tokens by swap and by
recompute; lookup drafts are accepted where the answer copies its prompt.

The draft model here is the target itself: it shows nothing of speed, but its greedy drafts are
the target's greedy tokens exactly when its K/V (in the same pages) came through every park
intact, so greedy drafts must all be accepted."""

import pytest
from serverproc import ServerProcess
from texts import LIGHTHOUSE

PASSAGE = LIGHTHOUSE
COPY = ("<|im_start|>user\nRepeat this text exactly:\n\n" + PASSAGE
        + "<|im_end|>\n<|im_start|>assistant\n")
STORY = ("<|im_start|>user\nWrite a short story about a fox who learns to sail."
         "<|im_end|>\n<|im_start|>assistant\n")
FLAGS = ["-np", "4", "-c", "4096", "--weights", "gguf"]  # as the smollm2_server fixture
SPEC = ["--spec-type", "ngram-simple"]
PARK_EVERY_16 = {"KVPARK_PREEMPT_EVERY": "16"}
COPY_TOKENS = 112  # seven parks in the copy alone, 13 with the two stories


def complete(server, prompt: str, n_predict: int, **fields) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True,
            **fields}
    response = server.post("/completion", body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def plain(smollm2_server):
    """Speculation off, no parks: what every other server must reproduce byte for byte."""
    return {"copy": complete(smollm2_server, COPY, COPY_TOKENS),
            "story": complete(smollm2_server, STORY, 48),
            "seeded": complete(smollm2_server, STORY, 48, temperature=0.8, seed=1234)}


def assert_same(got: dict, expected: dict) -> None:
    assert got["tokens"] == expected["tokens"]
    assert got["content"].encode() == expected["content"].encode()


@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_output_is_byte_identical_with_drafts_and_forced_parks(plain, park):
    flags = FLAGS + SPEC + (["--preempt-ram", "0"] if park == "recompute" else [])
    with ServerProcess(flags, model="builtin://smollm2-135m", env=PARK_EVERY_16) as server:
        copy = complete(server, COPY, COPY_TOKENS)
        assert_same(copy, plain["copy"])
        assert_same(complete(server, STORY, 48), plain["story"])
        assert_same(complete(server, STORY, 48, temperature=0.8, seed=1234), plain["seeded"])
        m = server.metrics()
    assert m[f"kvpark:n_preempt_{park}_total"] >= 6
    vllm = [v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total{")]
    assert vllm == [m["kvpark:spec_decode_num_accepted_tokens_total"]] and vllm[0] > 0
    # the copy is mostly drafted: most of its tokens came from accepted drafts
    assert copy["timings"]["draft_n_accepted"] > copy["tokens_predicted"] // 2
    assert 0 < copy["timings"]["draft_n_accepted"] <= copy["timings"]["draft_n"]


@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_a_draft_model_changes_nothing_and_its_kv_survive_forced_parks(plain, park):
    flags = FLAGS + ["--model-draft", "builtin://smollm2-135m"] + (
        ["--preempt-ram", "0"] if park == "recompute" else [])
    with ServerProcess(flags, model="builtin://smollm2-135m", env=PARK_EVERY_16) as server:
        copy = complete(server, COPY, COPY_TOKENS)
        story = complete(server, STORY, 48)
        seeded = complete(server, STORY, 48, temperature=0.8, seed=1234)
        m = server.metrics()
    assert_same(copy, plain["copy"])
    assert_same(story, plain["story"])
    assert_same(seeded, plain["seeded"])
    assert m[f"kvpark:n_preempt_{park}_total"] >= 6
    for greedy in (copy, story):  # a draft that is the target: every greedy draft accepted
        assert 0 < greedy["timings"]["draft_n_accepted"] == greedy["timings"]["draft_n"]
    assert seeded["timings"]["draft_n_accepted"] < seeded["timings"]["draft_n"]


def test_a_draft_with_another_kv_head_shape_is_refused_at_start():
    server = ServerProcess(["--model-draft", "synthetic:tiny-draft"],
                           model="builtin://smollm2-135m")
    with pytest.raises(RuntimeError) as failed:
        server.start()
    assert ("--model-draft synthetic:tiny-draft: its K/V heads are 3 x 8, the target's 3 x 64"
            in str(failed.value))
