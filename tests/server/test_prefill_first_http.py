"""`--prefill-first` on a real server: a stream that is decoding when a long prompt arrives sits
steps out while the prompt is prefilled (counted in /metrics, said in the log), and streams the
bytes it streams alone; the prompt's answer is its answer alone too. `--prefill-first 0` holds
no row."""

import concurrent.futures as cf
import json

import httpx
import pytest
from serverproc import ServerProcess

FLAGS = ["-np", "2", "-c", "4096", "-b", "32", "--no-prefix-cache"]  # LONG computed twice
HELD = "kvpark:decode_rows_held_total"
# long enough to be decoding still when the prompt below reaches the engine
STREAM = {"prompt": "a stream that waits its turn", "n_predict": 1000, "temperature": 0,
          "ignore_eos": True, "stream": True}
LONG = {"prompt": "a prompt of many words, " * 120, "n_predict": 8, "temperature": 0,
        "ignore_eos": True}


def stream_lines(server: ServerProcess, on_first=lambda: None) -> list[str]:
    """The SSE data lines of STREAM, the last without its timings; `on_first` is called once
    the first token has arrived."""
    lines: list[str] = []
    with httpx.stream("POST", f"{server.url}/completion", json=STREAM, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                lines.append(line)
                if len(lines) == 1:
                    on_first()
    last = json.loads(lines[-1][6:])
    del last["timings"]  # wall-clock figures
    return [*lines[:-1], json.dumps(last, sort_keys=True)]


def long_answer(server: ServerProcess) -> str:
    response = server.post("/completion", LONG)
    assert response.status_code == 200, response.text
    return response.json()["content"]


def stream_beside_long_prompt(server: ServerProcess) -> tuple[list[str], str]:
    """STREAM, with LONG sent as soon as the stream's first token is in."""
    with cf.ThreadPoolExecutor(1) as pool:
        sent: list[cf.Future] = []
        lines = stream_lines(server, on_first=lambda: sent.append(pool.submit(long_answer,
                                                                               server)))
        return lines, sent[0].result()


@pytest.mark.parametrize("limit", ["60", "0"])
def test_a_stream_sits_out_a_long_prompt_and_keeps_its_bytes(limit):
    with ServerProcess([*FLAGS, "--prefill-first", limit]) as server:
        assert ("scheduling: prompts first" in server.log()) == (limit != "0")
        alone, long_alone = stream_lines(server), long_answer(server)
        assert server.metric(HELD) == 0  # one sequence at a time: nobody to hold
        beside, long_beside = stream_beside_long_prompt(server)
        assert beside == alone
        assert long_beside == long_alone
        held = server.metric(HELD)
        # 600 prompt tokens in steps of 32: a held row for each step while a step's worth waits
        assert (held > 0) == (limit != "0"), held
