"""A bf16 KV pool (`-ctk bf16 -ctv bf16`, llama-server's names; `--kv-cache-dtype bfloat16`,
vLLM's): the server says so and its pool takes half the bytes of a float32 one; a request
parked by swap resumes from the bytes it parked and one parked by recompute replays to the same
tokens (the same token lines as a server that never parks); its system_fingerprint is not a
float32 pool's; at its defaults the pool is bf16 where prompt rows attend on AMX tiles; flags
that name two types, or a type the pool cannot take, exit with code 2 and one line."""

import json
import re
import subprocess
import sys

import httpx
import pytest
from serverproc import ServerProcess, free_port

BF16 = ["-np", "2", "-c", "2048", "-ctk", "bf16", "-ctv", "bf16"]
BODY = {"prompt": "a pool of halves", "n_predict": 60, "temperature": 0, "ignore_eos": True,
        "stream": True}


def token_lines(server: ServerProcess) -> list[str]:
    """The SSE data lines of a streamed greedy completion, the last without its timings."""
    with httpx.stream("POST", f"{server.url}/completion", json=BODY, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    last = json.loads(lines[-1][6:])
    del last["timings"]  # wall-clock figures
    return [*lines[:-1], json.dumps(last, sort_keys=True)]


def pool_line(server: ServerProcess) -> str:
    (line,) = re.findall(r"KV pool: .*", server.log())
    return line


def pool_mib(server: ServerProcess) -> float:
    return float(re.search(r"([\d.]+) MiB", pool_line(server)).group(1))


@pytest.fixture(scope="module")
def bf16():
    with ServerProcess(BF16) as server:
        yield server


@pytest.fixture(scope="module")
def fp32():
    with ServerProcess(["-np", "2", "-c", "2048", "--kv-cache-dtype", "float32"]) as server:
        yield server


def test_auto_keeps_bf16_where_prompt_rows_attend_on_amx(smollm2_server):
    """The default model at its defaults: bf16 K/V where its prompt rows' attention runs on AMX
    tiles (which round K and V to bf16 already), float32 elsewhere."""
    amx = "attention backend cpu+amx" in smollm2_server.log()
    assert ("bfloat16" if amx else "float32") in pool_line(smollm2_server)


def test_the_pool_is_bf16_in_half_the_bytes(bf16, fp32):
    assert "2048 tokens, bfloat16" in pool_line(bf16)
    assert "2048 tokens, float32" in pool_line(fp32)
    assert pool_mib(bf16) == pytest.approx(pool_mib(fp32) / 2, abs=0.1)


def test_its_fingerprint_is_not_a_float32_pools(bf16, fp32):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    prints = [s.post("/v1/chat/completions", body).json()["system_fingerprint"]
              for s in (bf16, fp32)]
    assert prints[0] != prints[1]


@pytest.mark.parametrize("parking", [["--kv-cache-dtype", "bfloat16"],
                                     ["-ctk", "bf16", "-ctv", "bf16", "--preempt-ram", "0"]],
                         ids=["swap", "recompute"])
def test_a_parked_request_gets_the_tokens_of_one_never_parked(bf16, parking):
    with ServerProcess(["-np", "2", "-c", "2048", *parking],
                       env={"KVPARK_PREEMPT_EVERY": "10"}) as parked:
        lines = token_lines(parked)
        mode = "recompute" if "--preempt-ram" in parking else "swap"
        assert parked.metric(f"kvpark:n_preempt_{mode}_total") >= 3
    assert lines == token_lines(bf16)


@pytest.mark.parametrize("flags,says", [
    (["-ctk", "bf16", "-ctv", "f32"], "K and V share one pool type"),
    (["-ctk", "bf16", "--kv-cache-dtype", "float32"], "K and V share one pool type"),
    (["-ctk", "f16", "-ctv", "f16"], "the KV pool cannot hold float16"),
])
def test_a_type_it_cannot_keep_exits_2_with_one_line(flags, says):
    cmd = [sys.executable, "-m", "kvpark.pod", "--model", "synthetic:tiny", "--host",
           "127.0.0.1", "--port", str(free_port()), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    assert len([line for line in output.splitlines() if says in line]) == 1, output
