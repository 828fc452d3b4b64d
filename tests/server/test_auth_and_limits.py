"""API key, client disconnects and the no-preempt pool wall, over real HTTP."""

import threading

import httpx
import openai
import pytest
from serverproc import ServerProcess

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_server():
    with ServerProcess(["-np", "2", "-c", "16384", "--api-key", KEY]) as server:
        yield server


def test_api_key_required_except_health_and_metrics(keyed_server):
    url = keyed_server.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    denied = keyed_server.chat("hi", max_tokens=2)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/slots").status_code == 401
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    out = right.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3)
    assert out.usage.completion_tokens <= 3
    assert KEY not in keyed_server.log()


def test_disconnect_mid_stream_frees_slot_and_pages(keyed_server):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{keyed_server.url}/v1/chat/completions", headers=headers,
                      timeout=60, json={"messages": [{"role": "user", "content": "go"}],
                                        # no max_tokens: it runs until we hang up
                                        "stream": True, "ignore_eos": True}) as response:
        lines = response.iter_lines()  # kept referenced: closing it would hang up
        for line in lines:
            if '"content": "' in line and '"content": ""' not in line:
                break
        busy = [s for s in keyed_server.slots(headers) if s["is_processing"]]
        assert len(busy) == 1 and busy[0]["n_tokens"] > 0
    # the connection is closed: the engine frees the slot within a step
    deadline_polls = 200
    for _ in range(deadline_polls):
        if not any(s["is_processing"] for s in keyed_server.slots(headers)):
            break
        threading.Event().wait(0.05)
    assert not any(s["is_processing"] for s in keyed_server.slots(headers))
    assert keyed_server.metric("kvpark:kv_cache_pages_free") == 16384 // 16


def test_no_preempt_pool_wall_fails_with_context_exceeded():
    """Two sequences that outgrow a 256-token pool together: without preemption one fails with
    llama.cpp's message, the other finishes."""
    import concurrent.futures as cf

    with ServerProcess(["-np", "2", "-c", "256", "--no-preempt"]) as server:
        body = {"prompt": "a b c d e f g h i j", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True}
        with cf.ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(lambda _: server.post("/v1/completions", body), range(2)))
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [200, 500]
        failed = next(r for r in responses if r.status_code == 500)
        assert failed.json()["error"]["message"] == "Context size has been exceeded."
        assert server.metric("kvpark:n_preempt_total") == 0
