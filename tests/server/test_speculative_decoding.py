"""`--spec-type ngram-simple` end to end with the real model: the output is byte-identical to
plain decoding (greedy and seeded sampling), with parks forced every 16 tokens by swap and by
recompute, and the drafts are accepted where the answer copies its prompt."""

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


def complete(server, prompt: str, n_predict: int, **fields) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "return_tokens": True,
            **fields}
    response = server.post("/completion", body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def plain(smollm2_server):
    """Speculation off, no parks: what every other server must reproduce byte for byte."""
    return {"copy": complete(smollm2_server, COPY, 160),
            "story": complete(smollm2_server, STORY, 48),
            "seeded": complete(smollm2_server, STORY, 48, temperature=0.8, seed=1234)}


def assert_same(got: dict, expected: dict) -> None:
    assert got["tokens"] == expected["tokens"]
    assert got["content"].encode() == expected["content"].encode()


@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_output_is_byte_identical_with_drafts_and_forced_parks(plain, park):
    flags = FLAGS + SPEC + (["--preempt-ram", "0"] if park == "recompute" else [])
    with ServerProcess(flags, model="builtin://smollm2-135m", env=PARK_EVERY_16) as server:
        copy = complete(server, COPY, 160)
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
