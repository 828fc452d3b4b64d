"""KV events for a router (issue 43), decoded by vLLM's own msgspec classes (read from its wheel
on PyPI, `tests/vllm_kv_events.py`): a prompt's full pages stored on GPU (the pool) with their
tokens and chained hashes; evicted pages removed from GPU and stored on CPU (the host tier);
numbered batches, and a replay of the ones a late subscriber missed; `vllm:cache_config_info`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest
import zmq
from serverproc import ServerProcess, free_port, poll

sys.path.insert(0, str(Path(__file__).parents[1]))
from vllm_kv_events import vllm_kv_events  # noqa: E402

PAGE = 16
TOPIC = "kv-events"
WAIT_MS = 20_000  # for a batch the server is known to be about to send


@pytest.fixture(scope="module")
def vllm():
    return vllm_kv_events()


@pytest.fixture(scope="module")
def ports():
    return free_port(), free_port()


@pytest.fixture(scope="module")
def server(ports):
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{ports[0]}", "replay_endpoint": f"tcp://*:{ports[1]}",
              "topic": TOPIC}
    # 8 pages: a second prompt evicts the first one's into the host tier
    with ServerProcess(["-np", "1", "-c", "128", "--kv-events-config", json.dumps(config)]
                       ) as server:
        yield server


@pytest.fixture(scope="module")
def subscriber(server, ports):
    context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.connect(f"tcp://127.0.0.1:{ports[0]}")
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    yield socket
    socket.close(linger=0)


def replayed(ports) -> list[tuple[int, bytes]]:
    """Every batch the server keeps, by number, through vLLM's replay protocol."""
    # a DEALER: the replay answers one request with many messages (a REQ takes only one)
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{ports[1]}")
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    batches = []
    try:
        while True:
            assert replay.poll(WAIT_MS), "the replay did not answer"
            _, number, payload = replay.recv_multipart()
            if int.from_bytes(number, "big", signed=True) == -1:  # vLLM's end of a replay
                assert payload == b""
                return batches
            batches.append((int.from_bytes(number, "big"), payload))
    finally:
        replay.close(linger=0)


def decoded(vllm, batches):
    decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    return [decoder.decode(payload) for _, payload in batches]


def events_of(batches, kind, medium=None):
    return [e for batch in batches for e in batch.events
            if type(e).__name__ == kind and (medium is None or e.medium == medium)]


def pages_of(events) -> dict[int, tuple[int, ...]]:
    """Each stored page's hash -> its tokens."""
    return {h: tuple(e.token_ids[i * PAGE:(i + 1) * PAGE]) for e in events
            for i, h in enumerate(e.block_hashes)}


def generate(server, tokens: list[int]) -> None:
    response = server.post("/v1/completions", {"prompt": tokens, "max_tokens": 1,
                                               "temperature": 0})
    assert response.status_code == 200, response.text


FIRST = [100 + i for i in range(4 * PAGE + 3)]
SECOND = [900 + i for i in range(7 * PAGE)]  # 7 of a pool of 8 pages: FIRST's are evicted


@pytest.fixture(scope="module")
def history(server, ports, vllm, subscriber):
    """The batches of two prompts, the second evicting the first's pages to the host."""
    generate(server, FIRST)
    first_pages = [tuple(FIRST[i * PAGE:(i + 1) * PAGE]) for i in range(4)]
    poll(lambda: set(first_pages) <= set(pages_of(events_of(
        decoded(vllm, replayed(ports)), "BlockStored", "GPU")).values()), "the first prompt")
    generate(server, SECOND)

    def evicted_and_kept() -> bool:
        batches = decoded(vllm, replayed(ports))
        removed = {h for e in events_of(batches, "BlockRemoved", "GPU") for h in e.block_hashes}
        return bool(removed) and removed <= set(pages_of(events_of(batches, "BlockStored",
                                                                  "CPU")))
    poll(evicted_and_kept, "the eviction")
    return replayed(ports)


def test_a_prompts_pages_are_stored_on_gpu_with_their_tokens(history, vllm):
    batches = decoded(vllm, history)
    assert type(batches[0].events[0]).__name__ == "AllBlocksCleared"  # a fresh process
    stored = events_of(batches, "BlockStored", "GPU")
    pages = pages_of(stored)
    assert list(pages.values())[:4] == [tuple(FIRST[i * PAGE:(i + 1) * PAGE]) for i in range(4)]
    assert stored[0].parent_block_hash is None and stored[0].block_size == PAGE
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in pages)
    chained = [e for e in stored if len(e.block_hashes) > 1 or e.parent_block_hash is not None]
    assert chained  # a run of pages is one event, each page the parent of the next


def test_evicted_pages_leave_the_gpu_and_are_kept_on_the_cpu(history, vllm):
    batches = decoded(vllm, history)
    first = {h: t for h, t in pages_of(events_of(batches, "BlockStored", "GPU")).items()
             if t in {tuple(FIRST[i * PAGE:(i + 1) * PAGE]) for i in range(4)}}
    removed = [h for e in events_of(batches, "BlockRemoved", "GPU") for h in e.block_hashes]
    on_host = pages_of(events_of(batches, "BlockStored", "CPU"))
    assert len(removed) >= 3 and set(removed) <= set(first)  # the pool's oldest: tail first
    assert all(on_host[h] == first[h] for h in removed)  # each kept on the host, same tokens


def test_batches_are_numbered_and_a_subscriber_gets_the_replayed_bytes(history, subscriber):
    numbers = [n for n, _ in history]
    assert numbers == list(range(len(numbers)))
    kept = dict(history)
    live = []
    while subscriber.poll(0):  # what the SUB socket heard (it may have missed the first)
        topic, number, payload = subscriber.recv_multipart()
        assert topic == TOPIC.encode()
        live.append((int.from_bytes(number, "big"), payload))
    assert live and all(kept[n] == payload for n, payload in live)
    assert [n for n, _ in live] == list(range(live[0][0], live[0][0] + len(live)))


def test_cache_config_info_gives_the_router_the_block_size(server):
    [info] = [name for name in server.metrics() if name.startswith("vllm:cache_config_info{")]
    assert 'block_size="16"' in info and 'num_gpu_blocks="8"' in info
