"""Big and pathological inputs: tokenising runs off the event loop, size limits refuse early,
and whatever the body holds, the answer is a small JSON 400, never a 500 or plain text.

One server with the default body limit (8 MiB), `--max-prompt-chars` raised far above what
its context holds (so a multi-megabyte prompt really reaches the tokenizer) and a small
`--max-messages`. The defaults (4096 messages, 32 characters per token of context) are held to
in test_api.py.
"""

import concurrent.futures as cf
import json

import httpx
import pytest
from serverproc import ServerProcess, poll

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
MAX_MESSAGES = 64
PREPARING = "kvpark:requests_preparing"


@pytest.fixture(scope="module")
def big_server():
    flags = ["-np", "2", "-c", "16384", "--max-prompt-chars", "16000000",
             "--max-messages", str(MAX_MESSAGES)]
    with ServerProcess(flags) as server:
        yield server


def content_chunks(lines):
    """The text deltas of an OpenAI chat stream, one per chunk that carries text."""
    for line in lines:
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                yield delta["content"]


def test_health_and_a_running_stream_answer_while_a_huge_prompt_is_tokenised(big_server):
    """A ~6.5 MB prompt takes seconds to tokenise. While it does (the server's own
    `requests_preparing` gauge says so before and after), /health and /slots answer and a
    running stream keeps sending tokens generated meanwhile; then the prompt gets its 400."""
    server = big_server
    huge = {"prompt": "hello world, how are you? " * 250_000, "max_tokens": 4}
    stream_body = {"messages": [{"role": "user", "content": "keep talking"}], "stream": True,
                   "ignore_eos": True}  # no max_tokens: it runs until we hang up
    with cf.ThreadPoolExecutor(1) as pool, \
            httpx.stream("POST", f"{server.url}{CHAT}", json=stream_body, timeout=120) as stream:
        chunks = content_chunks(stream.iter_lines())
        next(chunks)
        received = 1
        big = pool.submit(server.post, "/v1/completions", huge)
        poll(lambda: server.metric(PREPARING) == 1,
             "/metrics to answer while the huge prompt is being tokenised")
        assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "ok"}
        (running,) = [s for s in server.slots() if s["is_processing"]]
        generated = running["n_generated"]
        # the k-th text chunk needs k generated tokens: this one was sent after /slots answered
        while received <= generated:
            next(chunks)
            received += 1
        assert server.metric(PREPARING) == 1, ("the huge prompt is no longer being tokenised: "
                                               "the loop stalled until it was, or it was quick")
        assert not big.done()
        response = big.result()
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("Context size has been exceeded.")
    assert server.metric(PREPARING) == 0


def test_more_messages_than_max_messages_are_refused_before_templating(big_server):
    fine = big_server.post(CHAT, {"messages": MSG * MAX_MESSAGES, "max_tokens": 2})
    assert fine.status_code == 200, fine.text
    response = big_server.post(CHAT, {"messages": MSG * (MAX_MESSAGES + 1), "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "--max-messages" in error["message"]
    assert str(MAX_MESSAGES) in error["message"]


RAW_CASES = [
    # (what, body, param): each once gave a 500 with a plain-text body
    ("an integer past Python's 4300-digit limit",
     b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"7" * 4301 + b"}", "body"),
    ("100,000 levels of nesting", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "body"),
    ("a lone surrogate in the content",
     b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages[0].content"),
    ("an integer too large for a float",
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1' + b"0" * 400 + b"}",
     "temperature"),
]


@pytest.mark.parametrize("what,raw,param", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_pathological_json_gets_a_json_400(big_server, what, raw, param):
    response = httpx.post(f"{big_server.url}{CHAT}", content=raw, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, (what, response.text[:300])
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == 400
    assert len(response.content) < 1000
    assert big_server.chat("still here", max_tokens=2).status_code == 200


def test_a_one_megabyte_bad_value_is_not_echoed_in_full(big_server):
    for body in ({"messages": [{"role": "r" * 1_000_000, "content": "x"}]},
                 {"messages": MSG, "temperature": "t" * 1_000_000},
                 {"messages": MSG, "tools": [{"type": "function", "name": "f" * 1_000_000}]}):
        response = big_server.post(CHAT, body)
        assert response.status_code == 400
        assert len(response.content) < 1000, response.content[:300]
        assert "…" in response.json()["error"]["message"]  # cut, not left out
