"""Issue 6: stream notices, priority, manual park/unpark, watermarks, per-request accounting."""

import concurrent.futures as cf
import json

import httpx
import openai
import pytest
from serverproc import ServerProcess, poll

KEY = "k-beyond"
AUTH = {"Authorization": f"Bearer {KEY}"}


def raw_stream(url, path, body, headers=None):
    """Every SSE line of a streamed request, comments included."""
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


LLAMA = {"prompt": "notices please", "n_predict": 60, "temperature": 0, "ignore_eos": True,
         "stream": True}


@pytest.fixture(scope="module")
def plain():
    with ServerProcess(["-np", "2", "-c", "2048"]) as server:
        yield server


@pytest.fixture(scope="module")
def forced_swaps():
    with ServerProcess(["-np", "2", "-c", "2048"], env={"KVPARK_PREEMPT_EVERY": "10"}) as server:
        yield server


def test_parked_stream_gets_notices_and_identical_data(plain, forced_swaps):
    reference = raw_stream(plain.url, "/completion", LLAMA)
    lines = raw_stream(forced_swaps.url, "/completion", LLAMA)
    comments = [line for line in lines if line.startswith(":")]
    assert ": preempted" in comments and ": resumed" in comments
    assert comments.count(": preempted") == comments.count(": resumed") >= 5
    data = [line for line in lines if line.startswith("data:")]
    expected = [line for line in reference if line.startswith("data:")]
    assert data[:-1] == expected[:-1]  # every token line, byte for byte
    last, last_expected = json.loads(data[-1][6:]), json.loads(expected[-1][6:])
    del last["timings"], last_expected["timings"]  # wall-clock figures
    assert last == last_expected


def test_recompute_park_announces_the_replay_end():
    with ServerProcess(["-np", "2", "-c", "2048", "--preempt-ram", "0"],
                       env={"KVPARK_PREEMPT_EVERY": "10"}) as server:
        lines = raw_stream(server.url, "/completion", LLAMA)
    assert ": preempted" in lines and ": resumed" in lines and ": recomputed" in lines
    assert lines.index(": recomputed") > lines.index(": resumed")


def test_openai_client_ignores_the_notices(plain, forced_swaps):
    def content(server):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hello"}], temperature=0,
            max_tokens=50, stream=True, extra_body={"ignore_eos": True})
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert content(forced_swaps) == content(plain)


def test_non_streaming_body_carries_the_park_counts(plain, forced_swaps):
    body = {"prompt": "count my parks", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    parked = forced_swaps.post("/v1/completions", body).json()
    calm = plain.post("/v1/completions", body).json()
    assert parked["preempt"]["parks"] >= 3 and parked["preempt"]["recomputes"] == 0
    assert calm["preempt"] == {"parks": 0, "recomputes": 0}
    assert parked["choices"] == calm["choices"]


def test_request_parked_before_its_first_token_opens_with_a_notice_and_keepalives():
    with ServerProcess(["-np", "2", "-c", "1024", "--sse-keepalive", "0.05"]) as server, \
            cf.ThreadPoolExecutor(1) as pool:
        # no n_predict: it runs until it alone fills the pool ("length" at 1024 tokens); the
        # late prompt (~400 tokens) does not fit beside its 700, and it has ~300 tokens to go,
        # many keepalive periods (with 60 tokens to go it could end inside one: a flaky test)
        first = pool.submit(server.post, "/completion", {"prompt": "lead", "ignore_eos": True})
        poll(lambda: any(s["n_generated"] > 700 for s in server.slots()), "a pool 70% full")
        lines = raw_stream(server.url, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "late " * 400}],
                            "stream": True, "max_tokens": 5, "ignore_eos": True})
        assert first.result().status_code == 200
    assert lines[0] == ": preempted"
    assert ": keepalive" in lines[: lines.index(": resumed")]
    assert lines[-1] == "data: [DONE]"


def test_a_queued_stream_says_so_and_gets_keepalives_until_it_runs():
    """A stream waiting for a slot has its 200 headers at once; without a byte after them a
    proxy's idle timeout would cut it before it is admitted."""
    with ServerProcess(["-np", "1", "-c", "1024", "--sse-keepalive", "0.05"]) as server, \
            cf.ThreadPoolExecutor(1) as pool:
        first = pool.submit(server.post, "/completion",
                            {"prompt": "hold the only slot", "n_predict": 400, "ignore_eos": True})
        poll(lambda: any(s["n_generated"] > 5 for s in server.slots()), "the slot taken")
        lines = raw_stream(server.url, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "queued"}],
                            "stream": True, "max_tokens": 5, "ignore_eos": True})
        assert first.result().status_code == 200
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
    assert lines[0] == ": queued"
    assert lines[1:first_data] and set(lines[1:first_data]) == {": keepalive"}
    assert ": keepalive" not in lines[first_data:]  # running: it has data to send
    assert lines[-1] == "data: [DONE]"


def test_an_admitted_stream_is_never_told_it_queues(plain):
    lines = raw_stream(plain.url, "/completion", {**LLAMA, "n_predict": 5})
    assert not [line for line in lines if line.startswith(":")]


def test_priority_parks_only_the_low_tier(plain):
    with ServerProcess(["-np", "2", "-c", "1024"]) as server, cf.ThreadPoolExecutor(2) as pool:
        body = {"prompt": "tiers", "n_predict": 700, "ignore_eos": True, "temperature": 0,
                "stream": True}
        low = pool.submit(raw_stream, server.url, "/completion", {**body, "priority": -1})
        poll(lambda: any(s["n_generated"] > 300 for s in server.slots()), "the low stream")
        high = pool.submit(raw_stream, server.url, "/completion", {**body, "priority": 5})
        seen = poll(lambda: [s for s in server.slots() if s["is_processing"]
                             and s["priority"] == 5], "the high stream")
        assert seen[0]["priority"] == 5
        low_lines, high_lines = low.result(), high.result()
    assert ": preempted" in low_lines and ": preempted" not in high_lines
    assert json.loads(low_lines[-1][6:])["tokens_predicted"] == 700
    assert json.loads(high_lines[-1][6:])["tokens_predicted"] == 700


def test_priority_must_be_an_int32(plain):
    for bad in ("high", 2**31, 1.5, True):
        response = plain.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "priority": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


def test_manual_park_and_unpark_keep_the_output_byte_identical(plain):
    body = {"prompt": "park me by hand", "n_predict": 300, "temperature": 0,
            "ignore_eos": True, "return_tokens": True}
    reference = plain.post("/completion", body).json()
    with ServerProcess(["-np", "2", "-c", "2048", "--api-key", KEY]) as server, \
            cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(server.post, "/completion", body, headers=AUTH)
        slot = poll(lambda: [s for s in server.slots(AUTH) if s["n_generated"] > 20], "tokens")
        slot_id = slot[0]["id"]
        assert server.post(f"/slots/{slot_id}?action=park", {}).status_code == 401
        parked = httpx.post(f"{server.url}/slots/{slot_id}?action=park", headers=AUTH).json()
        assert parked["is_preempted"] and parked["preempt_manual"]
        assert parked["preempt_mode"] == "swap"
        # it stays parked while another request comes and goes
        other = server.post("/completion", {"prompt": "x", "n_predict": 20}, headers=AUTH)
        assert other.status_code == 200
        assert server.slots(AUTH)[slot_id]["is_preempted"]
        again = httpx.post(f"{server.url}/slots/{slot_id}?action=park", headers=AUTH)
        assert again.status_code == 409
        resumed = httpx.post(f"{server.url}/slots/{slot_id}?action=unpark", headers=AUTH).json()
        assert not resumed["is_preempted"] and not resumed["preempt_manual"]
        # a swap comes back from the pool's cache and host RAM, never by a recompute (a park on
        # a page boundary has no partial page to take from host RAM)
        assert resumed["resumed_from"] and set(resumed["resumed_from"]) <= {"pool", "host"}
        got = running.result().json()
        assert httpx.post(f"{server.url}/slots/9?action=park", headers=AUTH).status_code == 404
        bad = httpx.post(f"{server.url}/slots/0?action=explode", headers=AUTH)
        assert bad.status_code == 400
    assert got["tokens"] == reference["tokens"]
    assert got["content"].encode() == reference["content"].encode()
    assert got["preempt"]["parks"] == 1


def test_watermarks_park_before_the_wall_and_hold_restores_back():
    prompts = [f"chat {i} " * 30 for i in range(3)]
    flags = ["-np", "3", "-c", "1024"]
    with ServerProcess(flags) as server, cf.ThreadPoolExecutor(3) as pool:
        m0 = server.metrics()
        results = list(pool.map(lambda p: server.post(
            "/completion", {"prompt": p, "n_predict": 500, "ignore_eos": True}), prompts))
        m = server.metrics()
    assert all(r.status_code == 200 for r in results)
    assert m0["kvpark:preempt_high_watermark_cells"] == int(64 * 0.94) * 16
    assert m0["kvpark:preempt_low_watermark_cells"] == int(64 * 0.80) * 16
    assert m["kvpark:n_preempt_watermark_total"] > 0
    assert m["kvpark:n_restore_refused_watermark_total"] > 0
    with ServerProcess([*flags, "--preempt-high", "100", "--preempt-low", "100"]) as server, \
            cf.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda p: server.post(
            "/completion", {"prompt": p, "n_predict": 500, "ignore_eos": True}), prompts))
        off = server.metrics()
    assert off["kvpark:n_preempt_watermark_total"] == 0
    assert off["kvpark:n_restore_refused_watermark_total"] == 0


def test_per_request_park_histograms(forced_swaps):
    before = forced_swaps.metrics()
    body = {"prompt": "histogram", "n_predict": 45, "ignore_eos": True}
    parks = [forced_swaps.post("/completion", body).json()["preempt"]["parks"] for _ in range(2)]
    after = forced_swaps.metrics()

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("kvpark:request_preemptions_count") == 2
    assert delta("kvpark:request_preemptions_sum") == sum(parks) >= 8
    assert delta("kvpark:request_parked_seconds_count") == 2
    assert delta("kvpark:request_parked_seconds_sum") > 0
