"""Parking a hybrid model (Qwen3.5's layout: Gated DeltaNet layers with a state slot per
sequence beside the attention layers' pages) over real HTTP: a swap copies pages and state and
gives both back byte for byte, a recompute drops both and replays, the budget counts the state.

`synthetic:tiny-hybrid` keeps these fast; `tiny-hybrid-wide` has a 1.5 MiB state slot, so a
1 MiB budget holds a short sequence's pages (16 KiB each) but not its pages and state."""

import concurrent.futures as cf

import httpx
import pytest
from serverproc import ServerProcess, poll

GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
PROMPTS = ["the delta rule keeps one state per sequence",
           "attention keeps pages, and the hybrid keeps both of them " * 3]


def hybrid(flags: list[str], env: dict[str, str] | None = None,
           model: str = "synthetic:tiny-hybrid") -> ServerProcess:
    """Dense float32 linears unless the flags say otherwise: `--weights auto` measures blocks
    against them at start, and with blocks a generated token's page is not a prompt's (the
    prefix cache tells them apart), which the checkpoint tests here do not ask about."""
    weights = [] if "--weights" in flags else ["--weights", "fp32"]
    return ServerProcess(["-np", "2", *weights, *flags], env=env or {}, model=model)


def complete(server, prompt, n_predict):
    return server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY})


def tokens_of(server, n_predict=96):
    return [complete(server, p, n_predict).json()["tokens"] for p in PROMPTS]


@pytest.fixture(scope="module")
def unforced():
    with hybrid(["-c", "4096"]) as server:
        yield tokens_of(server)


def test_forced_swaps_give_state_and_pages_back_byte_for_byte(unforced):
    with hybrid(["-c", "4096"], {"KVPARK_PREEMPT_EVERY": "8"}) as server:
        got = tokens_of(server)
        m = server.metrics()
    assert got == unforced
    assert m["kvpark:n_preempt_total"] >= 20
    assert m["kvpark:n_preempt_swap_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:n_resume_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:preempt_ram_bytes"] == 0


def test_forced_recomputes_replay_to_the_same_bytes(unforced):
    with hybrid(["-c", "4096", "--preempt-ram", "0"], {"KVPARK_PREEMPT_EVERY": "8"}) as server:
        got = tokens_of(server)
        m = server.metrics()
    assert got == unforced
    assert m["kvpark:n_preempt_total"] >= 20
    assert m["kvpark:n_preempt_recompute_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:n_recompute_tokens_total"] > 0


@pytest.mark.parametrize("budget", ["8192", "0"], ids=["swap", "recompute"])
def test_decode_rows_from_blocks_park_and_replay_to_the_same_bytes(budget):
    """`--weights gguf`: generated-token rows read Q8_0 blocks made at load, prompt rows dense;
    a recompute replay reads them as the first pass did, so a replayed state is bit for bit."""
    with hybrid(["-c", "4096", "--weights", "gguf"]) as server:
        expected = tokens_of(server)
        assert "made Q8_0 blocks at load" in server.log()
    with hybrid(["-c", "4096", "--weights", "gguf", "--preempt-ram", budget],
                {"KVPARK_PREEMPT_EVERY": "8"}) as server:
        got = tokens_of(server)
        m = server.metrics()
    assert got == expected
    assert m["kvpark:n_preempt_total"] >= 20


@pytest.mark.parametrize("budget", ["8192", "0"], ids=["swap", "recompute"])
def test_two_requests_that_overflow_the_pool_both_finish(budget):
    with hybrid(["-c", "512", "--preempt-ram", budget]) as server:
        with cf.ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: complete(server, p, 400), ["one two three",
                                                                        "four five six seven"]))
        m = server.metrics()
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["tokens_predicted"] for a in answers] == [400, 400]
    assert m["kvpark:n_preempt_total"] >= 1
    mode = "swap" if budget != "0" else "recompute"
    assert m[f"kvpark:n_preempt_{mode}_total"] == m["kvpark:n_preempt_total"]


@pytest.mark.parametrize("budget,mode", [("1", "recompute"), ("4", "swap")])
def test_the_budget_counts_the_state_slot(budget, mode):
    """A 1 MiB budget holds the pages of these sequences (a few 16 KiB pages) but not their
    1.5 MiB state as well: it must recompute; 4 MiB holds both: it swaps."""
    with hybrid(["-c", "4096", "--preempt-ram", budget], {"KVPARK_PREEMPT_EVERY": "8"},
                model="synthetic:tiny-hybrid-wide") as server:
        answer = complete(server, PROMPTS[0], 24)
        m = server.metrics()
    assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 24
    assert m["kvpark:n_preempt_total"] >= 2
    assert m[f"kvpark:n_preempt_{mode}_total"] == m["kvpark:n_preempt_total"]


def test_slots_and_metrics_show_both_kinds_of_memory():
    """Pages of the 2 attention layers (2 x K,V x 16 tokens x 2 heads x 32 dims x 4 B) and a
    state slot of the 6 DeltaNet layers (conv 128 x 3 + state 4 x 16 x 16 floats each)."""
    with hybrid(["-c", "512"]) as server:
        m = server.metrics()
        slots = server.slots()
    assert m["kvpark:kv_cache_page_bytes"] == 2 * 2 * 16 * 2 * 32 * 4
    assert m["kvpark:state_slot_bytes"] == 6 * (128 * 3 + 4 * 16 * 16) * 4
    assert m["kvpark:state_slots_total"] == 2 and m["kvpark:state_slots_used"] == 0
    assert [s["state_bytes"] for s in slots] == [m["kvpark:state_slot_bytes"]] * 2
    assert not any(s["state_resident"] for s in slots)


def test_a_manual_park_gives_the_state_slot_up_and_unpark_continues_exactly(tmp_path):
    key = {"Authorization": "Bearer k-hybrid"}
    body = {"prompt": PROMPTS[0], "n_predict": 300, **GREEDY}
    with hybrid(["-c", "4096", "--api-key", "k-hybrid", "--slot-save-path", str(tmp_path)]
                ) as server, cf.ThreadPoolExecutor(1) as pool:
        reference = server.post("/completion", body, headers=key).json()
        running = pool.submit(server.post, "/completion", body, headers=key)
        slot = poll(lambda: [s for s in server.slots(key) if s["n_generated"] > 20], "tokens")
        slot_id = slot[0]["id"]
        assert slot[0]["state_resident"]
        parked = httpx.post(f"{server.url}/slots/{slot_id}?action=park", headers=key).json()
        assert parked["is_preempted"] and parked["preempt_mode"] == "swap"
        assert not parked["state_resident"]
        assert server.metrics()["kvpark:state_slots_used"] == 0
        resumed = httpx.post(f"{server.url}/slots/{slot_id}?action=unpark", headers=key).json()
        assert resumed["state_resident"]
        got = running.result().json()
        saved = httpx.post(f"{server.url}/slots/{slot_id}?action=save", headers=key,
                           json={"filename": "hybrid.bin"})
    assert got["tokens"] == reference["tokens"] and got["preempt"]["parks"] == 1
    # the parked and resumed sequence's pages and checkpoint save as any other's
    assert saved.status_code == 200 and saved.json()["n_saved"] == 304 // 16 * 16
    assert [p.name for p in tmp_path.iterdir()] == ["hybrid.bin"]


def test_a_failing_request_ends_alone_and_the_others_state_is_untouched(unforced):
    """An injected fault fails its step before any state slot is written: the step is rerun
    one sequence at a time, the faulty one ends with an error and the other continues to the
    bytes it gives alone."""
    poison = 49151
    with hybrid(["-c", "4096"], {"KVPARK_INJECT_FAULT_TOKEN": str(poison)}) as server:
        ids = server.post("/tokenize", {"content": PROMPTS[1]}).json()["tokens"]
        with cf.ThreadPoolExecutor(2) as pool:
            good = pool.submit(complete, server, PROMPTS[0], 96)
            bad = pool.submit(server.post, "/completion",
                              {"prompt": [*ids[:5], poison, *ids[5:]], "n_predict": 20,
                               **GREEDY})
            good, bad = good.result(), bad.result()
        m = server.metrics()
    assert m["kvpark:kv_cache_pages_free"] == m["kvpark:kv_cache_pages_total"]
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["tokens"] == unforced[0]


def test_a_step_failing_after_the_state_was_written_costs_only_the_faulty_request(unforced):
    """The fault strikes after the step's forward: every state slot in it has advanced. Its
    sequences are parked by recompute (state dropped, replayed), each then runs alone: the
    faulty one fails again and ends, the other finishes to the bytes it gives alone."""
    poison = 49151
    key = {"Authorization": "Bearer k-fault"}
    with hybrid(["-c", "4096", "--api-key", "k-fault"],
                {"KVPARK_INJECT_FAULT_TOKEN": str(poison), "KVPARK_INJECT_FAULT_LATE": "1"}
                ) as server, cf.ThreadPoolExecutor(1) as pool:
        ids = server.post("/tokenize", {"content": PROMPTS[1]}, headers=key).json()["tokens"]
        good = pool.submit(server.post, "/completion",
                           {"prompt": PROMPTS[0], "n_predict": 96, **GREEDY}, headers=key)
        poll(lambda: [s for s in server.slots(key) if s["n_generated"] > 4], "decoding")
        bad = server.post("/completion", {"prompt": [*ids[:5], poison, *ids[5:]],
                                          "n_predict": 20, **GREEDY}, headers=key)
        good = good.result()
        m = server.metrics()
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["tokens"] == unforced[0]
    assert m["kvpark:n_preempt_recompute_total"] == 2  # both, from the step they shared
    assert m["kvpark:kv_cache_pages_free"] == m["kvpark:kv_cache_pages_total"]


def conversation(server, first: list[int], more: list[int]) -> tuple[dict, dict]:
    """Turn 1, then turn 2 re-sending turn 1 (prompt and answer) with more tokens: token ids,
    so both servers see the same history whatever the tokenizer would merge."""
    one = server.post("/completion", {"prompt": first, "n_predict": 40, **GREEDY}).json()
    two = server.post("/completion", {"prompt": [*first, *one["tokens"], *more],
                                      "n_predict": 40, **GREEDY}).json()
    return one, two


@pytest.fixture(scope="module")
def history():
    with hybrid(["-c", "4096", "--no-prefix-cache"]) as server:
        first = server.post("/tokenize", {"content": PROMPTS[1]}).json()["tokens"]
        more = server.post("/tokenize", {"content": " And what comes next?"}).json()["tokens"]
        yield first, more, conversation(server, first, more), retold(server, first, more)


def retold(server, first: list[int], more: list[int]) -> dict:
    """Turn 1's prompt again with other words after it (a client that re-renders the answer
    into other tokens shares only the prompt)."""
    return server.post("/completion", {"prompt": [*first, *more], "n_predict": 24,
                                       **GREEDY}).json()


def test_a_returning_conversation_resumes_from_a_state_checkpoint(history):
    """Turn 2 takes turn 1's pages from the prefix cache up to the checkpoint at turn 1's last
    page boundary, its state from the checkpoint, and gives the bytes of a server without a
    cache."""
    first, more, (one, two), _ = history
    with hybrid(["-c", "4096"]) as server:
        got_one, got_two = conversation(server, first, more)
        m = server.metrics()
    assert got_one["tokens"] == one["tokens"] and got_two["tokens"] == two["tokens"]
    turn_one = len(first) + len(one["tokens"]) - 1  # its last sample is never fed
    assert got_two["timings"]["cache_n"] == turn_one // 16 * 16
    assert m["kvpark:state_checkpoint_hits_total"] == 1
    assert m["kvpark:state_checkpoint_tokens_total"] == turn_one // 16 * 16
    # in the pool's memory (--ctx-checkpoints 2 per slot: 4), none in host RAM yet
    slot_bytes = 6 * (128 * 3 + 4 * 16 * 16) * 4
    assert 1 <= m["kvpark:state_checkpoints"] == m["kvpark:state_checkpoints_in_pool"] <= 4
    assert m["kvpark:state_checkpoint_pool_bytes"] == 4 * slot_bytes
    assert m["kvpark:state_checkpoint_bytes"] == 0


@pytest.mark.parametrize("per_slot,hits", [("2", 1), ("0", 0)])
def test_without_a_host_budget_the_pools_checkpoints_keep_the_prefix_usable(
        history, per_slot, hits):
    """--preempt-ram 0 leaves no host RAM for checkpoints: those in the pool's memory
    (--ctx-checkpoints) still let turn 2 start from turn 1's last page boundary; with none,
    it computes everything again. The bytes are the same either way."""
    first, more, (one, two), _ = history
    with hybrid(["-c", "4096", "--preempt-ram", "0", "--ctx-checkpoints", per_slot]) as server:
        got_one, got_two = conversation(server, first, more)
        m = server.metrics()
    assert got_one["tokens"] == one["tokens"] and got_two["tokens"] == two["tokens"]
    assert m["kvpark:state_checkpoint_hits_total"] == hits
    assert (got_two["timings"]["cache_n"] > 0) == bool(hits)


def test_a_conversation_that_shares_only_the_prompt_resumes_from_its_last_page(history):
    """A prefill chunk stops on the prompt's last page boundary and the state there is kept
    at once: a next request that shares only the prompt starts from it."""
    first, more, _, expected = history
    with hybrid(["-c", "4096"]) as server:
        server.post("/completion", {"prompt": first, "n_predict": 40, **GREEDY})
        got = retold(server, first, more)
        m = server.metrics()
    assert got["tokens"] == expected["tokens"]
    assert got["timings"]["cache_n"] == len(first) // 16 * 16 > 0
    assert m["kvpark:state_checkpoint_hits_total"] == 1


def test_a_recompute_resume_replays_from_its_checkpoint_not_token_0():
    """`tiny-hybrid-wide`: a 1.5 MiB state slot; a ~600-token sequence's pages (16 KiB each)
    and state do not fit 2 MiB, so it parks by recompute, but its state checkpoint (1.5 MiB)
    does: each resume replays only the tokens since its last page boundary."""
    wide = "synthetic:tiny-hybrid-wide"
    prompt = "the state is saved at page boundaries " * 80
    with hybrid(["-c", "4096"], model=wide) as server:
        expected = complete(server, prompt, 40).json()["tokens"]
    with hybrid(["-c", "4096", "--preempt-ram", "2"], {"KVPARK_PREEMPT_EVERY": "8"},
                model=wide) as server:
        got = complete(server, prompt, 40).json()["tokens"]
        m = server.metrics()
    assert got == expected
    parks = m["kvpark:n_preempt_total"]
    assert parks >= 4 and m["kvpark:n_preempt_recompute_total"] == parks
    assert m["kvpark:state_checkpoint_hits_total"] == parks
    assert 0 < m["kvpark:n_recompute_tokens_total"] <= parks * 16
