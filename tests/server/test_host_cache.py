"""The host tier over real HTTP: a conversation whose pages another pushed out of a small pool
comes back from host RAM instead of being computed again, with the same bytes out as a server
without the tier, parks every few tokens included; /metrics and /slots say what happened."""

import pytest
from serverproc import ServerProcess

PS = 16  # the default --page-size
# a 256-token pool: the second conversation evicts the first one's pages
FLAGS = ["-np", "2", "-c", "256"]
PARKS = {"KVPARK_PREEMPT_EVERY": "8"}
MODEL = "builtin://smollm2-135m"  # real weights: GGUF blocks for decode rows, fp32 prompt rows


def complete(server, prompt, n_predict) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    response = server.post("/completion", body)
    assert response.status_code == 200, response.text
    return response.json()


def conversation(server) -> list[dict]:
    """Turn 1 of A, then B (which pushes A's pages out of the pool), then turn 2 of A."""
    turn1 = list(range(1000, 1100))
    first = complete(server, turn1, 24)
    other = complete(server, list(range(3000, 3236)), 8)  # 244 tokens: the whole pool
    second = complete(server, turn1 + first["tokens"] + list(range(2000, 2040)), 24)
    return [first, other, second]


@pytest.fixture(scope="module")
def both():
    with ServerProcess([*FLAGS, "--no-host-cache"], env=PARKS, model=MODEL) as off:
        without = conversation(off)
        off_metrics = off.metrics()
    with ServerProcess(FLAGS, env=PARKS, model=MODEL) as on:
        with_tier = conversation(on)
        yield without, off_metrics, with_tier, on.metrics()


def test_the_output_is_the_same_bytes_with_the_tier_on_and_off(both):
    without, _, with_tier, metrics = both
    for off, on in zip(without, with_tier):
        assert on["tokens"] == off["tokens"]
        assert on["content"].encode() == off["content"].encode()
    assert metrics["kvpark:n_preempt_swap_total"] >= 4  # parks in the middle of the answers


def test_a_pushed_out_prefix_comes_back_from_host_ram(both):
    without, off_metrics, with_tier, metrics = both
    assert without[2]["timings"]["cache_n"] == 0  # without the tier: computed again
    assert with_tier[2]["timings"]["cache_n"] == 100 // PS * PS  # turn 1's full prompt pages
    assert metrics["kvpark:host_cache_hits_total"] >= 100 // PS
    assert metrics["kvpark:host_cache_saves_total"] > 0
    assert off_metrics["kvpark:host_cache_saves_total"] == 0


def test_host_bytes_are_split_into_parked_and_cached(both):
    *_, metrics = both
    assert metrics["kvpark:preempt_ram_bytes"] == 0  # nobody parked now
    assert metrics["kvpark:host_cache_bytes"] > 0
    assert metrics["kvpark:host_cache_pages"] >= 100 // PS
    assert metrics["kvpark:host_cache_save_seconds_count"] > 0
