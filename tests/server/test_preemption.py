"""The spec's preemption tests over real HTTP: swap under --preempt-ram, recompute above it.

The seeded tiny model keeps these fast; its KV pages are 6 KiB each (2 layers x 3 KV heads x 8
dims x 16 tokens x K and V in fp32), so a 1 MiB budget holds about 2700 parked tokens.
"""

import concurrent.futures as cf
import time

import httpx
import pytest
from serverproc import ServerProcess, poll

GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}


def complete(server, prompt, n_predict, **extra):
    return server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY,
                                       **extra})


def run_pair(server, prompts, n_predict):
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(server, p, n_predict), prompts))


@pytest.fixture(scope="module")
def reference_server():
    with ServerProcess(["-np", "2", "-c", "4096"]) as server:
        yield server


def test_forced_swap_parks_are_byte_identical(reference_server):
    prompts = ["the first prompt for exactness", "a second, rather different prompt " * 3]
    expected = [complete(reference_server, p, 120).json() for p in prompts]
    with ServerProcess(["-np", "2", "-c", "4096"], env={"KVPARK_PREEMPT_EVERY": "16"}) as server:
        got = [complete(server, p, 120).json() for p in prompts]
        m = server.metrics()
        assert "preempt-every 16" in server.log()
    for e, g in zip(expected, got):
        assert g["tokens"] == e["tokens"] and g["content"].encode() == e["content"].encode()
    assert m["kvpark:n_preempt_total"] >= 6
    assert m["kvpark:n_preempt_swap_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:n_preempt_recompute_total"] == 0
    assert m["kvpark:n_resume_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:preempt_ram_bytes"] == 0 and m["kvpark:requests_preempted"] == 0


@pytest.fixture(scope="module")
def recompute_server():
    with ServerProcess(["-np", "2", "-c", "512", "--preempt-ram", "0"]) as server:
        yield server


def test_budget_zero_overflowing_pair_finishes_by_recompute(recompute_server):
    responses = run_pair(recompute_server, ["one two three", "four five six seven"], 400)
    assert [r.status_code for r in responses] == [200, 200]
    assert all(r.json()["tokens_predicted"] == 400 for r in responses)
    m = recompute_server.metrics()
    assert m["kvpark:n_preempt_total"] >= 1
    assert m["kvpark:n_preempt_recompute_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:n_preempt_swap_total"] == 0
    assert m["kvpark:requests_preempted"] == 0 and m["kvpark:preempt_ram_bytes"] == 0
    assert recompute_server.count_in_log("parked by recompute") >= 1


def test_no_preempt_same_pair_fails_with_context_exceeded():
    with ServerProcess(["-np", "2", "-c", "512", "--no-preempt"]) as server:
        responses = run_pair(server, ["one two three", "four five six seven"], 400)
        assert sorted(r.status_code for r in responses) == [200, 500]
        failed = next(r for r in responses if r.status_code == 500)
        assert failed.json()["error"]["message"] == "Context size has been exceeded."
        assert server.metric("kvpark:n_preempt_total") == 0


def test_recomputed_request_reports_the_prompt_as_sent(recompute_server):
    prompts = ["count the words in this prompt please", "and a second prompt to race it"]
    sent = [recompute_server.post("/v1/completions", {"prompt": p, "max_tokens": 1}
                                  ).json()["usage"]["prompt_tokens"] for p in prompts]
    before = recompute_server.metric("kvpark:n_recompute_tokens_total")
    started = time.monotonic()
    responses = run_pair(recompute_server, prompts, 400)
    wall_ms = (time.monotonic() - started) * 1e3
    assert recompute_server.metric("kvpark:n_recompute_tokens_total") > before
    for body, prompt_tokens in zip([r.json() for r in responses], sent):
        t = body["timings"]
        assert t["prompt_n"] == body["tokens_evaluated"] == prompt_tokens
        # replays are not prompt time: prompt and generation together fit in the wall clock
        assert 0 < t["prompt_ms"] and t["prompt_ms"] + t["predicted_ms"] <= wall_ms


def test_budget_inside_park_sizes_mixes_swap_and_recompute():
    # one long prompt leads; three short chats are the victims, about 1300 tokens (~0.5 MiB)
    # each when the pool fills: the first two fit the 1 MiB budget together, the third does not
    prompts = [list(range(1000, 4000)), "short one", "short two", "short three"]
    with ServerProcess(["-np", "4", "-c", "8192", "--preempt-ram", "1"]) as server:
        with cf.ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda p: complete(server, p, 2000), prompts))
        m = server.metrics()
    assert [r.status_code for r in responses] == [200] * 4
    assert all(r.json()["tokens_predicted"] == 2000 for r in responses)
    assert m["kvpark:n_preempt_swap_total"] > 0 and m["kvpark:n_preempt_recompute_total"] > 0
    assert (m["kvpark:n_preempt_swap_total"] + m["kvpark:n_preempt_recompute_total"]
            == m["kvpark:n_preempt_total"])
    assert m["kvpark:preempt_ram_budget_bytes"] == 1 << 20


def test_slots_show_parked_mode_during_run_and_nothing_after(recompute_server):
    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(complete, recompute_server, p, 450) for p in ("aa bb", "cc dd ee")]
        parked = poll(lambda: [s for s in recompute_server.slots() if s["is_preempted"]],
                      "a parked slot")
        results = [f.result() for f in futures]
    assert parked[0]["preempt_mode"] == "recompute" and parked[0]["n_preempt"] >= 1
    assert all(r.status_code == 200 for r in results)
    assert not any(s["is_preempted"] for s in recompute_server.slots())
    assert recompute_server.metric("kvpark:requests_preempted") == 0


def test_late_large_prompt_parks_someone_instead_of_failing():
    with ServerProcess(["-np", "2", "-c", "1024"]) as server, cf.ThreadPoolExecutor(2) as pool:
        long_run = pool.submit(complete, server, "keep going", 900)
        poll(lambda: any(s["n_generated"] > 500 for s in server.slots()), "500 tokens")
        late = pool.submit(complete, server, list(range(1000, 1600)), 20)
        assert late.result().status_code == 200 and late.result().json()["tokens_predicted"] == 20
        assert long_run.result().status_code == 200
        assert long_run.result().json()["tokens_predicted"] == 900
        assert server.metric("kvpark:n_preempt_total") >= 1


def test_refused_host_allocation_falls_through_to_recompute(reference_server):
    expected = complete(reference_server, "fallback prompt", 80).json()
    with ServerProcess(["-np", "2", "-c", "4096"],
                       env={"KVPARK_PREEMPT_EVERY": "20", "KVPARK_PREEMPT_FAIL_SWAP": "1"}
                       ) as server:
        got = complete(server, "fallback prompt", 80)
        m = server.metrics()
    assert got.status_code == 200 and got.json()["tokens_predicted"] == 80
    assert len(got.json()["tokens"]) == len(expected["tokens"])
    assert m["kvpark:n_preempt_total"] >= 3
    assert m["kvpark:n_preempt_recompute_total"] == m["kvpark:n_preempt_total"]
    assert m["kvpark:n_preempt_swap_fallback_total"] == m["kvpark:n_preempt_total"]


def test_disconnect_while_parked_frees_host_ram_and_slot():
    with ServerProcess(["-np", "2", "-c", "4096"]) as server:
        url = f"{server.url}/v1/chat/completions"
        leader_body = {"messages": [{"role": "user", "content": "lead " * 40}], "stream": True,
                       "ignore_eos": True, "temperature": 0}
        parked_body = {"messages": [{"role": "user", "content": "park me"}], "stream": True,
                       "ignore_eos": True, "temperature": 0}
        with httpx.stream("POST", url, json=leader_body, timeout=120) as leader, \
                httpx.stream("POST", url, json=parked_body, timeout=120) as victim:
            leader_lines, victim_lines = leader.iter_lines(), victim.iter_lines()
            next(leader_lines), next(victim_lines)  # both streams are open
            parked = poll(lambda: [s for s in server.slots() if s["is_preempted"]],
                          "the second chat parked by swap")
            assert parked[0]["preempt_mode"] == "swap"
            assert server.metric("kvpark:preempt_ram_bytes") > 0
            victim.close()  # hang up while parked
            poll(lambda: server.metric("kvpark:preempt_ram_bytes") == 0, "host RAM freed")
            assert sum(s["is_processing"] for s in server.slots()) == 1
            assert server.metric("kvpark:requests_preempted") == 0


def test_auto_budget_from_a_fake_cgroup_file(tmp_path):
    limit = 6 * 1024 * 1024 * 1024
    cgroup = tmp_path / "memory.max"
    cgroup.write_text(f"{limit}\n")
    env = {"KVPARK_CGROUP_MEMORY_MAX": str(cgroup), "KVPARK_MEMORY_LIMIT": ""}
    with ServerProcess(["--preempt-ram", "auto"], env=env) as server:
        budget = server.metric("kvpark:preempt_ram_budget_bytes")
        log = server.log()
    resident_mib = int(log.split("resident ")[1].split(" MiB")[0])
    headroom = int(limit * 0.10)
    expected = limit - resident_mib * 2**20 - headroom
    assert f"limit 6144 MiB from {cgroup}" in log
    assert abs(budget - expected) < 2**20  # the log rounds the resident size to a MiB
