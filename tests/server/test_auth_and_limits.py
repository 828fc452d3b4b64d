"""API key and client disconnects over real HTTP (the pool wall is in test_preemption)."""

import threading

import httpx
import openai
import pytest
from serverproc import ServerProcess, poll

KEY = "s3cret-key"
ADMIN = "adm1n-key"


@pytest.fixture(scope="module")
def keyed_server():
    with ServerProcess(["-np", "2", "-c", "16384", "--api-key", KEY, "--admin-key", ADMIN]
                       ) as server:
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


def test_an_x_api_key_header_is_a_key_too(keyed_server):
    """As llama-server's web UI and Anthropic-style clients send it; wrong is still 401."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    url = f"{keyed_server.url}/v1/chat/completions"
    assert httpx.post(url, json=body, headers={"X-Api-Key": KEY}, timeout=60).status_code == 200
    wrong = httpx.post(url, json=body, headers={"X-Api-Key": "nope"}, timeout=60)
    assert wrong.status_code == 401
    admin = httpx.post(f"{keyed_server.url}/slots/0?action=park", headers={"X-Api-Key": ADMIN},
                       timeout=60)
    assert admin.status_code == 409  # past the key: slot 0 is idle


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


def test_admin_actions_are_off_without_a_key(tiny_server):
    for action in ("park", "unpark"):
        refused = httpx.post(f"{tiny_server.url}/slots/0?action={action}")
        assert refused.status_code == 403
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and "--admin-key" in error["message"]
    assert httpx.get(f"{tiny_server.url}/slots").status_code == 200  # reading stays open


def test_admin_key_guards_slot_actions(keyed_server):
    url = f"{keyed_server.url}/slots/0?action=park"
    assert httpx.post(url).status_code == 401
    wrong = httpx.post(url, headers={"Authorization": f"Bearer {KEY}"})
    assert wrong.status_code == 401 and "admin key" in wrong.json()["error"]["message"]
    idle = httpx.post(url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert idle.status_code == 409 and "idle" in idle.json()["error"]["message"]
    assert ADMIN not in keyed_server.log()


def test_a_key_sent_in_the_query_string_never_reaches_the_access_log(keyed_server):
    """Only the Authorization header is read, but clients put keys in URLs too: the access log
    keeps each query's names and writes every value as [redacted]."""
    url = keyed_server.url
    assert httpx.get(f"{url}/v1/models?api_key={KEY}").status_code == 401
    assert httpx.get(f"{url}/v1/models?key={ADMIN}&{KEY}",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # uvicorn writes the line after the response: wait for it
    log = poll(lambda: "GET /v1/models?key=" in keyed_server.log() and keyed_server.log(),
               "the access log line")
    assert '"GET /v1/models?api_key=[redacted] HTTP/1.1" 401' in log
    assert '"GET /v1/models?key=[redacted]&[redacted] HTTP/1.1" 200' in log
    assert KEY not in log and ADMIN not in log


def test_exactly_the_paths_the_readme_names_answer_without_the_key(keyed_server):
    """Every GET route of the app, asked without the key: those that answer are the ones the
    README's --api-key row lists, and no other."""
    import re
    from pathlib import Path

    from kvpark.pod.args import parse_args
    from kvpark.pod.http.app import create_app

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--api-key KEY`"))
    named = set(re.findall(r"`(/[a-z./-]+)`", row.split("on everything but", 1)[1]))
    paths = {route.path for route in create_app(parse_args([])).routes
             if "GET" in (route.methods or ()) and "{" not in route.path}
    open_paths = {p for p in paths
                  if httpx.get(f"{keyed_server.url}{p}", timeout=30).status_code != 401}
    assert open_paths == named == {"/health", "/metrics", "/openapi.json", "/version"}
