"""Speculative decoding of a hybrid model (Qwen3.5's layout) over real HTTP. A verified step
feeds [last token, d1..dk] through the DeltaNet layers, whose state then holds every draft; the
chunk keeps the state after each row, and where a draft is rejected the state goes back to the
one after the last accepted row (a page boundary inside the accepted rows takes its checkpoint
snapshot from there too). So the output is byte-identical to plain decoding, with drafts by
lookup and by a (dense) draft model, with parks forced, and a conversation's next turn resumes
from a checkpoint taken inside a speculative step to the same bytes."""

import json

import pytest
from serverproc import ServerProcess

GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
# the second repeats itself: lookup drafts its repetition, which the model does not follow
PROMPTS = ["the delta rule keeps one state per sequence",
           "attention keeps pages, and the hybrid keeps both of them " * 3]
NEW_TURN = " and then the next turn of the conversation asks again"
NGRAM = ["--spec-type", "ngram-simple"]
DRAFT_MODEL = ["--model-draft", "synthetic:tiny-hybrid-draft"]


def hybrid(flags: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    # dense linears (`auto` could pick blocks, whose generated pages a next turn cannot share)
    return ServerProcess(["-np", "2", "-c", "4096", "--weights", "fp32", *flags], env=env or {},
                         model="synthetic:tiny-hybrid")


def complete(server, prompt, n_predict, **fields) -> dict:
    response = server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY,
                                           **fields})
    assert response.status_code == 200, response.text
    return response.json()


def conversation(server) -> list[dict]:
    """Each prompt, then its next turn (the history re-sent as token ids with new text; with
    logprobs, which tell a state off by a token where this tiny model's greedy tokens, stuck
    on one token, would not)."""
    answers = []
    for prompt in PROMPTS:
        first = complete(server, prompt, 150)
        history = server.post("/tokenize", {"content": prompt}).json()["tokens"]
        new = server.post("/tokenize", {"content": NEW_TURN}).json()["tokens"]
        answers += [first, complete(server, history + first["tokens"] + new, 40, n_probs=3)]
    return answers


def assert_same(got: list[dict], expected: list[dict]) -> None:
    assert [a["tokens"] for a in got] == [a["tokens"] for a in expected]
    assert [a["content"].encode() for a in got] == [a["content"].encode() for a in expected]
    probs = [json.dumps(a.get("completion_probabilities")) for a in got]
    assert probs == [json.dumps(a.get("completion_probabilities")) for a in expected]


@pytest.fixture(scope="module")
def plain():
    """No drafts, no prefix cache: every turn computed from scratch."""
    with hybrid(["--no-prefix-cache"]) as server:
        return conversation(server)


@pytest.mark.parametrize("drafts", [NGRAM, DRAFT_MODEL], ids=["lookup", "draft-model"])
def test_drafts_leave_the_output_byte_identical_and_rejected_rows_are_taken_back(plain, drafts):
    with hybrid(drafts) as server:
        got = conversation(server)
        m = server.metrics()
    assert_same(got, plain)
    accepted = m["kvpark:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < m["kvpark:spec_decode_num_draft_tokens_total"]  # some rejected
    # the next turns resumed from checkpoints (the first turns' last page boundaries). A draft
    # model that paused holds back its target's last pages from the cache (it has not written
    # their K/V), and a checkpoint needs its page cached: there only one of them does
    hits = 2 if drafts == NGRAM else 1
    assert m["kvpark:state_checkpoint_hits_total"] >= hits
    assert sum(a["timings"]["cache_n"] > 0 for a in got[1::2]) >= hits


@pytest.mark.parametrize("budget", ["4096", "0"], ids=["swap", "recompute"])
def test_drafts_and_forced_parks_together_give_the_same_bytes(plain, budget):
    with hybrid([*NGRAM, "--preempt-ram", budget], {"KVPARK_PREEMPT_EVERY": "8"}) as server:
        got = conversation(server)
        m = server.metrics()
    assert_same(got, plain)
    assert m["kvpark:n_preempt_total"] >= 20
    assert m["kvpark:spec_decode_num_accepted_tokens_total"] > 0


def test_a_hybrid_draft_model_is_refused_at_start_naming_why():
    server = ServerProcess(["-np", "1", "--model-draft", "synthetic:tiny-hybrid"],
                           model="synthetic:tiny-hybrid")
    with pytest.raises(RuntimeError, match="exited 2") as refused:
        server.start()
    assert "it is a hybrid model" in str(refused.value)
