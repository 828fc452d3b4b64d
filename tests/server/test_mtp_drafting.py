"""Drafting with a Qwen3.5 checkpoint's own MTP head (`--spec-type draft-mtp`) over real HTTP:
output byte-identical to plain decoding (greedy and seeded), across forced swap and recompute
parks; a head built to predict the model (`mtp_models.predicting_weights`) has its drafts
accepted, with parks too; its K/V ride in the pages through both park modes (a slot file of
the conversation, which holds every layer's pages and the state checkpoint, has the same bytes
with parks as without); a model without a head refuses the flag at start."""

import sys
from pathlib import Path

import httpx
import pytest
from serverproc import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtp_models import predicting_weights, write_dir  # noqa: E402

GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
SEEDED = {"temperature": 0.9, "seed": 4321, "ignore_eos": True, "return_tokens": True}
PROMPTS = ["the delta rule keeps one state per sequence",
           "attention keeps pages, and the hybrid keeps both of them " * 3]
MTP = ["--spec-type", "draft-mtp"]
PARKS = {"none": ([], {}),
         "swap": ([], {"KVPARK_PREEMPT_EVERY": "6"}),
         "recompute": (["--preempt-ram", "0"], {"KVPARK_PREEMPT_EVERY": "6"})}


def answers(model: str, flags: list[str], env: dict[str, str] | None = None,
            samplings: tuple[dict, ...] = (GREEDY,)) -> tuple[list[dict], dict]:
    """Each prompt under each sampling, in order, on one server; and its metrics."""
    with ServerProcess(["-np", "2", "-c", "4096", "--weights", "fp32", *flags], env=env or {},
                       model=model) as server:
        got = []
        for sampling in samplings:
            for prompt in PROMPTS:
                body = {"prompt": prompt, "n_predict": 80, **sampling}
                response = server.post("/completion", body)
                assert response.status_code == 200, response.text
                got.append(response.json())
        return got, server.metrics()


def drafted(got: list[dict]) -> list[tuple[int, int]]:
    """Per answer: draft tokens verified, and accepted."""
    return [(a["timings"]["draft_n"], a["timings"]["draft_n_accepted"]) for a in got]


@pytest.fixture(scope="module")
def predicting(tmp_path_factory):
    """A head whose attention block makes about half its guesses wrong: which ones depends on
    its K/V of the earlier positions."""
    return str(write_dir(predicting_weights(attention_scale=60.0),
                         tmp_path_factory.mktemp("mtp") / "model"))


@pytest.fixture(scope="module")
def plain(predicting):
    return {"random": answers("synthetic:tiny-hybrid-mtp", [], samplings=(GREEDY, SEEDED))[0],
            "predicting": answers(predicting, [])[0]}


def assert_same(got: list[dict], expected: list[dict]) -> None:
    assert [a["tokens"] for a in got] == [a["tokens"] for a in expected]
    assert [a["content"].encode() for a in got] == [a["content"].encode() for a in expected]


@pytest.mark.parametrize("park", list(PARKS))
def test_a_random_head_leaves_the_output_byte_identical(plain, park):
    """Greedy and seeded sampling alike."""
    flags, env = PARKS[park]
    got, m = answers("synthetic:tiny-hybrid-mtp", MTP + flags, env, samplings=(GREEDY, SEEDED))
    assert_same(got, plain["random"])
    assert m["kvpark:spec_decode_num_draft_tokens_total"] > 0
    assert m['kvpark:spec_decode_type{spec_type="draft-mtp"}'] == 1
    if park != "none":
        assert m[f"kvpark:n_preempt_{park}_total"] >= 10


@pytest.mark.parametrize("park", list(PARKS))
def test_a_head_that_predicts_exactly_has_every_draft_accepted(tmp_path_factory, park):
    """Its attention block silenced, the head guesses token p + 2 exactly as the model will
    compute it: every draft is accepted, with parks as without (a seed made for the wrong
    position, or from the wrong token, would be rejected)."""
    model = str(write_dir(predicting_weights(attention_scale=0.0),
                          tmp_path_factory.mktemp("exact") / "model"))
    flags, env = PARKS[park]
    got, m = answers(model, MTP + flags, env)
    made, accepted = (m[f"kvpark:spec_decode_num_{k}_total"] for k in ("draft_tokens",
                                                                        "accepted_tokens"))
    assert made >= 60 and accepted == made
    if park != "none":
        assert m[f"kvpark:n_preempt_{park}_total"] >= 10


@pytest.fixture(scope="module")
def predicted(predicting, plain, tmp_path_factory):
    """Per park mode, one slot: the answer, the metrics and the slot's file once it ended."""
    found = {}
    for park, (flags, env) in PARKS.items():
        slots = tmp_path_factory.mktemp(f"slots-{park}")
        with ServerProcess(["-np", "1", "-c", "4096", "--weights", "fp32",
                            "--slot-save-path", str(slots),
                            "--admin-key", "k", *MTP, *flags], env=env, model=predicting
                           ) as server:
            got = server.post("/completion", {"prompt": PROMPTS[1], "n_predict": 80,
                                              **GREEDY}).json()
            saved = httpx.post(f"{server.url}/slots/0?action=save", json={"filename": "c.bin"},
                               headers={"Authorization": "Bearer k"}, timeout=60)
            assert saved.status_code == 200, saved.text
            found[park] = got, server.metrics(), (slots / "c.bin").read_bytes()
        assert_same([got], plain["predicting"][1:])
    return found


def test_a_predicting_heads_drafts_are_accepted(predicted):
    got, m, _ = predicted["none"]
    made, accepted = (m[f"kvpark:spec_decode_num_{k}_total"] for k in ("draft_tokens",
                                                                        "accepted_tokens"))
    assert made >= 30 and accepted >= made // 3  # a random head's: none (the test above)
    assert drafted([got]) == [(made, accepted)]


@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_the_heads_drafts_are_accepted_across_parks(predicted, park):
    got, m, _ = predicted[park]
    assert m[f"kvpark:n_preempt_{park}_total"] >= 10
    made, accepted = drafted([got])[0]
    assert made >= 30 and accepted >= made // 3


@pytest.mark.parametrize("park", ["swap", "recompute"])
def test_parks_give_the_heads_kv_back_byte_for_byte(predicted, park):
    """The slot's pages (the model's layers and the head's) after parks every few tokens are
    the bytes of the run without: the head's K/V came back (swap) or were computed again to
    the same bits (recompute: the end-of-step pass runs over a replay's rows too)."""
    assert predicted[park][2] == predicted["none"][2]


def test_a_model_without_a_head_refuses_draft_mtp_at_start():
    server = ServerProcess(["-np", "1", *MTP], model="synthetic:tiny-hybrid")
    with pytest.raises(RuntimeError, match="exited 2") as refused:
        server.start()
    assert "has no multi-token-prediction head" in str(refused.value)
