"""Slot files of a hybrid model (Qwen3.5's layout) over real HTTP: a hybrid's cached pages are
usable only up to a state checkpoint, so its file ends at the latest page that has one and
carries that checkpoint. A restarted server restores it and the conversation's next turn resumes
from it byte-identically to a server that computed everything from scratch."""

import hashlib
import json
import struct

import httpx
import pytest
from serverproc import ServerProcess

KEY = "slot-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PS = 16  # the default --page-size
GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
PROMPT = list(range(1000, 1100))
NEW_TURN = list(range(2000, 2030))
HYBRID = "synthetic:tiny-hybrid"


def complete(server, prompt, n_predict) -> dict:
    response = server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def slot_action(server, action, filename=None) -> httpx.Response:
    body = {} if filename is None else {"filename": filename}
    return httpx.post(f"{server.url}/slots/0?action={action}", json=body, headers=AUTH,
                      timeout=60)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def saver(slot_dir, model=HYBRID) -> ServerProcess:
    return ServerProcess(["-np", "1", "-c", "4096", "--weights", "fp32",  # as the reference
                          "--slot-save-path", str(slot_dir),
                          "--admin-key", KEY], model=model)


@pytest.fixture(scope="module")
def reference():
    """The conversation and its next turn computed from scratch (no cache, no files)."""
    with ServerProcess(["-np", "1", "-c", "512", "--no-prefix-cache", "--weights", "fp32"],
                       model=HYBRID) as server:
        history = PROMPT + complete(server, PROMPT, 40)["tokens"]
        yield history, complete(server, history + NEW_TURN, 20)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, reference):
    """One conversation on a hybrid server, its slot saved; the directory and the answer."""
    slot_dir = tmp_path_factory.mktemp("hybrid-slots")
    history, _ = reference
    with saver(slot_dir) as server:
        assert PROMPT + complete(server, PROMPT, 40)["tokens"] == history
        answer = ok(slot_action(server, "save", "conv.bin"))
        checkpoints = server.metric("kvpark:state_checkpoints")
        assert ok(slot_action(server, "erase"))["n_erased"] == 128
        erased = server.metrics()
    return slot_dir, answer, checkpoints, erased


def test_the_file_ends_at_the_last_checkpoint_and_carries_its_state(saved, reference):
    slot_dir, answer, checkpoints, _ = saved
    history, _ = reference
    # 139 tokens computed: the state was last kept at the page boundary 128 (and the prompt's
    # last one, 96); the file holds the pages up to 128 and the state there
    assert answer["n_saved"] == (len(history) - 1) // PS * PS == 128
    assert checkpoints == 2
    data = (slot_dir / "conv.bin").read_bytes()
    header = json.loads(data[16:16 + struct.unpack_from("<I", data, 12)[0]])
    assert header["state_bytes"] > 0 and header["identity"]["state_layout"].startswith("6x(")
    assert len(data) == answer["n_written"]


def test_erase_drops_the_slots_checkpoints_with_its_pages(saved):
    _, _, _, erased = saved
    assert erased["kvpark:kv_cache_pages_cached"] == 0
    assert erased["kvpark:state_checkpoints"] == 0


def test_a_restarted_server_resumes_the_next_turn_from_the_files_checkpoint(saved, reference):
    slot_dir, answer, _, _ = saved
    history, expected = reference
    with saver(slot_dir) as server:
        assert ok(slot_action(server, "restore", "conv.bin"))["n_restored"] == 128
        assert server.metric("kvpark:state_checkpoints") == 1
        # remembered on the slot: saved again, the same bytes come out
        assert ok(slot_action(server, "save", "again.bin"))["n_saved"] == 128
        assert (slot_dir / "again.bin").read_bytes() == (slot_dir / "conv.bin").read_bytes()
        got = complete(server, history + NEW_TURN, 20)
        m = server.metrics()
    assert got["timings"]["cache_n"] == 128  # pages and state from the file, not a replay
    assert m["kvpark:state_checkpoint_hits_total"] == 1
    assert got["tokens"] == expected["tokens"]
    assert got["content"].encode() == expected["content"].encode()


def recrafted_state(data: bytes, value: float) -> bytes:
    """The file with its state's last float32 (a recurrent state's) set, digest made valid."""
    body = bytearray(data[:-32])
    body[-4:] = struct.pack("<f", value)
    return bytes(body) + hashlib.sha256(body).digest()


def test_files_a_hybrid_cannot_use_are_refused_naming_why(saved):
    slot_dir, _, _, _ = saved
    data = (slot_dir / "conv.bin").read_bytes()
    (slot_dir / "nan.bin").write_bytes(recrafted_state(data, float("nan")))
    (slot_dir / "same.bin").write_bytes(recrafted_state(data, 0.5))
    with saver(slot_dir) as server:
        problem = slot_action(server, "restore", "nan.bin")
        assert problem.status_code == 400 and "not finite" in problem.json()["error"]["message"]
        assert ok(slot_action(server, "restore", "same.bin"))["n_restored"] == 128
    with saver(slot_dir, model="synthetic:tiny-hybrid-wide") as server:  # another state layout
        problem = slot_action(server, "restore", "conv.bin")
        assert problem.status_code == 400, problem.text
        assert "state_layout: file '6x(" in problem.json()["error"]["message"]
        complete(server, PROMPT, 4)  # still serving
