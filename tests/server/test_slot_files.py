"""Slot files over real HTTP, llama-server's API: `--slot-save-path DIR` and
`POST /slots/{id}?action=save|restore|erase`. A restored slot continues byte-identically to a
server that never saved, on the same server and on a restarted one; a file from another layout,
a damaged file and a name that leads out of DIR are refused; the admin key guards it all."""

import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import time

import httpx
import pytest
from serverproc import ServerProcess

KEY = "slot-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PS = 16  # the default --page-size
GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
PROMPT = list(range(1000, 1100))
NEW_TURN = list(range(2000, 2030))


def complete(server, prompt, n_predict) -> dict:
    response = server.post("/completion", {"prompt": prompt, "n_predict": n_predict, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def slot_action(server, action, filename=None, slot=0, headers=AUTH) -> httpx.Response:
    body = {} if filename is None else {"filename": filename}
    return httpx.post(f"{server.url}/slots/{slot}?action={action}", json=body, headers=headers,
                      timeout=60)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A directory holding the slot directory: nothing may ever be written here."""
    return tmp_path_factory.mktemp("outside")


@pytest.fixture(scope="module")
def slot_dir(outside):
    return outside / "slots"  # the server creates it


def saver_flags(slot_dir, *extra):
    return ["-np", "1", "-c", "4096", "--slot-save-path", str(slot_dir), "--admin-key", KEY,
            *extra]


@pytest.fixture(scope="module")
def saver(slot_dir):
    with ServerProcess(saver_flags(slot_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def reference():
    """A server that never saves nor caches anything (no --slot-save-path, no prefix cache):
    the conversation and its continuation computed from scratch."""
    with ServerProcess(["-np", "1", "-c", "512", "--no-prefix-cache", "--admin-key", KEY]
                       ) as server:
        first = complete(server, PROMPT, 40)
        history = PROMPT + first["tokens"]
        yield server, history, complete(server, history + NEW_TURN, 20)


@pytest.fixture(scope="module")
def saved(saver, slot_dir, reference):
    """One conversation on the saver, its slot saved to conv.bin."""
    _, history, _ = reference
    assert PROMPT + complete(saver, PROMPT, 40)["tokens"] == history
    answer = ok(slot_action(saver, "save", "conv.bin"))
    return answer, (slot_dir / "conv.bin").read_bytes()


def assert_same_continuation(server, reference, cached: int) -> None:
    _, history, expected = reference
    got = complete(server, history + NEW_TURN, 20)
    assert got["timings"]["cache_n"] == cached  # the restored pages were used
    assert got["tokens"] == expected["tokens"]
    assert got["content"].encode() == expected["content"].encode()


def test_save_reports_the_whole_pages_it_wrote_and_the_file_size(saved, reference):
    answer, data = saved
    _, history, _ = reference
    # the conversation computed all but its last sampled token; whole pages of those are saved
    assert answer["n_saved"] == (len(history) - 1) // PS * PS == 128
    assert answer["n_written"] == len(data)
    assert answer["id_slot"] == 0 and answer["filename"] == "conv.bin"
    assert answer["timings"]["save_ms"] >= 0


def test_erase_then_restore_continues_byte_identically_from_the_cache(saver, saved, reference):
    answer, data = saved
    assert ok(slot_action(saver, "erase"))["n_erased"] == answer["n_saved"]
    assert saver.metric("kvpark:kv_cache_pages_cached") == 0  # its pages are gone
    restored = ok(slot_action(saver, "restore", "conv.bin"))
    assert restored == {**restored, "id_slot": 0, "filename": "conv.bin",
                        "n_restored": answer["n_saved"], "n_read": len(data)}
    assert saver.metric("kvpark:kv_cache_pages_cached") == answer["n_saved"] // PS
    hits = saver.metric("kvpark:prefix_cache_hits_total")
    assert_same_continuation(saver, reference, answer["n_saved"])
    assert saver.metric("kvpark:prefix_cache_hits_total") - hits == answer["n_saved"]


def test_a_restarted_server_continues_byte_identically_from_the_file(slot_dir, saved, reference):
    answer, _ = saved
    with ServerProcess(saver_flags(slot_dir)) as server:
        assert server.metric("kvpark:kv_cache_pages_cached") == 0
        assert ok(slot_action(server, "restore", "conv.bin"))["n_restored"] == answer["n_saved"]
        # the restore is remembered on the slot: saved again, the same bytes come out
        assert ok(slot_action(server, "save", "again.bin"))["n_saved"] == answer["n_saved"]
        assert (slot_dir / "again.bin").read_bytes() == saved[1]
        assert_same_continuation(server, reference, answer["n_saved"])


def test_a_file_from_another_kv_layout_is_refused_naming_what_differs(slot_dir, saved):
    with ServerProcess(saver_flags(slot_dir, "--page-size", "32")) as server:
        problem = error(slot_action(server, "restore", "conv.bin"), 400)
        assert "different model or KV layout" in problem["message"]
        assert "page_size: file 16, this server 32" in problem["message"]
        assert problem["param"] == "filename"
        assert server.metric("kvpark:kv_cache_pages_cached") == 0
        complete(server, PROMPT, 4)  # still serving


def test_damaged_files_are_refused_and_the_server_keeps_serving(saver, saved, slot_dir):
    _, data = saved
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # in the pages
    damaged = {"flipped.bin": (bytes(flipped), "SHA-256 does not match"),
               "short.bin": (data[:len(data) // 2], "truncated"),
               "junk.bin": (b"not a slot file at all", "not a kvpark slot file")}
    for name, (content, why) in damaged.items():
        (slot_dir / name).write_bytes(content)
        problem = error(slot_action(saver, "restore", name), 400)
        assert why in problem["message"] and problem["param"] == "filename"
    assert "no slot file" in error(slot_action(saver, "restore", "missing.bin"), 404)["message"]
    complete(saver, PROMPT, 4)
    assert ok(slot_action(saver, "restore", "conv.bin"))["n_read"] == len(data)


def test_names_that_lead_out_of_the_directory_are_refused(saver, saved, slot_dir, outside):
    target = outside / "target.bin"
    (slot_dir / "link").symlink_to(target)  # inside DIR, pointing out of it
    before = sorted(p.name for p in outside.iterdir())
    names = ["../x", "/etc/passwd", "a/b", "..", ".", "", ".hidden", "x" * 300, "a\\b",
             "link", None, 5]
    for name in names:
        for action in ("save", "restore"):
            problem = error(slot_action(saver, action, name), 400)
            assert problem["param"] == "filename", (name, action, problem)
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing written outside
    assert not target.exists() and not (slot_dir / "a").exists()
    assert not (slot_dir / ".hidden").exists()


def test_slot_files_are_admin_actions(saver, tiny_server):
    for action in ("save", "restore", "erase"):
        off = error(slot_action(tiny_server, action, "conv.bin", headers={}), 403)
        assert "--admin-key" in off["message"]
        wrong = slot_action(saver, action, "conv.bin", headers={"Authorization": "Bearer no"})
        assert "admin key" in error(wrong, 401)["message"]


def test_without_a_slot_save_path_save_and_restore_say_how_to_enable_them(reference):
    server, _, _ = reference
    for action in ("save", "restore"):
        problem = error(slot_action(server, action, "conv.bin"), 400)
        assert "--slot-save-path" in problem["message"]
        assert problem["type"] == "not_supported_error"
    assert ok(slot_action(server, "erase")) == {"id_slot": 0, "n_erased": 0}


def test_a_busy_slot_is_refused_while_its_sequence_runs_or_is_parked(saver, saved):
    """Last in this file: the cancelled stream becomes the slot's last sequence."""
    body = {"prompt": PROMPT, "n_predict": 3000, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{saver.url}/completion", json=body, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the stream
        assert next(lines).startswith("data: ")  # it runs
        ok(slot_action(saver, "park"))  # now it holds the slot until unparked: no race
        for action in ("save", "restore", "erase"):
            problem = error(slot_action(saver, action, "conv.bin"), 409)
            assert problem["message"] == "slot 0 is busy" and problem["type"] == "conflict"
        ok(slot_action(saver, "unpark"))


def recrafted(data: bytes, header_change=None, kv_change=None) -> bytes:
    """`data` with its header or its pages changed and a digest that matches again: a file
    someone with access to the directory wrote by hand."""
    magic, version, header_len = struct.unpack_from("<8sII", data)
    start = struct.calcsize("<8sII")
    header = json.loads(data[start:start + header_len])
    if header_change is not None:
        header = header_change(header)
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    body = bytearray(data[start + header_len:-32])
    if kv_change is not None:
        kv_change(body, 8 * header["num_tokens"])
    prefix = struct.pack("<8sII", magic, version, len(text)) + text + bytes(body)
    return prefix + hashlib.sha256(prefix).digest()


def no_pages(header: dict) -> dict:
    return {**header, "num_tokens": 0, "num_prompt": 0, "num_pages": 0,
            "kv_shape": [header["kv_shape"][0], 0, *header["kv_shape"][2:]]}


def nested(header: dict) -> bytes:
    return b'{"identity": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def float_at_kv(value: float):
    def change(body: bytearray, kv_at: int) -> None:
        body[kv_at:kv_at + 4] = struct.pack("<f", value)  # the pool is float32 here
    return change


CRAFTED = {
    "no-pages.bin": (no_pages, None, "holds no pages"),
    "nested.bin": (nested, None, "header is not a JSON object"),
    "identity-list.bin": (lambda h: {**h, "identity": [1, 2]}, None, "model identity"),
    "identity-deep.bin": (lambda h: {**h, "identity": {**h["identity"], "model": {"a": 1}}},
                          None, "model identity"),
    "sizes-text.bin": (lambda h: {**h, "num_tokens": "128"}, None, "'num_tokens'"),
    "shape-text.bin": (lambda h: {**h, "kv_shape": "x"}, None, "'kv_shape'"),
    "nan.bin": (None, float_at_kv(float("nan")), "not finite"),
    "inf.bin": (None, float_at_kv(float("-inf")), "not finite"),
}


def test_crafted_files_with_a_valid_digest_are_refused_by_what_is_wrong(saver, saved, slot_dir):
    """Each file's SHA-256 matches, so only the checks of what it holds can refuse it; none
    may answer 500 or leave a page behind."""
    _, data = saved
    cached = saver.metric("kvpark:kv_cache_pages_cached")
    for name, (header_change, kv_change, why) in CRAFTED.items():
        (slot_dir / name).write_bytes(recrafted(data, header_change, kv_change))
        problem = error(slot_action(saver, "restore", name), 400)
        assert why in problem["message"], (name, problem)
        assert problem["param"] == "filename"
        assert saver.metric("kvpark:kv_cache_pages_cached") == cached, name
    complete(saver, PROMPT, 4)  # still serving
    (slot_dir / "same.bin").write_bytes(recrafted(data))  # the checks pass a file as written
    assert ok(slot_action(saver, "restore", "same.bin"))["n_read"] == len(data)


def test_saving_onto_a_directory_is_a_conflict_and_leaves_no_file(saver, saved, slot_dir):
    (slot_dir / "taken").mkdir()
    problem = error(slot_action(saver, "save", "taken"), 409)
    assert "is a directory" in problem["message"] and problem["param"] == "filename"
    assert not any(p.name.endswith(".tmp") for p in slot_dir.iterdir())
    assert (slot_dir / "taken").is_dir()


def test_a_restart_removes_temporary_files_of_saves_that_never_finished(slot_dir, saved):
    """A writer killed mid-save leaves its temporary file; the next start removes those of
    dead writers on this host and stale ones of any host, never a live writer's."""
    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 2 * 3600
    files = {f".kvpark-{host}-{dead.pid}-abc123.tmp": False,  # its writer is gone: removed
             f".kvpark-{host}-{os.getpid()}-abc123.tmp": True,  # a live writer's: kept
             ".kvpark-other-host-7-abc123.tmp": True,  # another pod's, fresh: kept
             ".kvpark-other-host-7-old123.tmp": False,  # another pod's, long untouched
             ".k2j4h5g6.tmp": False}  # an older server's name, long untouched
    for name in files:
        (slot_dir / name).write_bytes(b"x" * 1000)
    for name in (".kvpark-other-host-7-old123.tmp", ".k2j4h5g6.tmp"):
        os.utime(slot_dir / name, (old, old))
    with ServerProcess(saver_flags(slot_dir)) as server:
        assert server.count_in_log("removed 3 temporary files of saves that never finished")
        for name, kept in files.items():
            assert (slot_dir / name).exists() == kept, name
    for name in files:
        (slot_dir / name).unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 KiB tmpfs (a slot file here is ~50 KB), where the system lets this test mount one
    (root in a sandbox)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_saving_to_a_full_disk_is_a_507_and_leaves_no_partial_file(small_disk, reference):
    with ServerProcess(saver_flags(small_disk)) as server:
        complete(server, PROMPT, 40)
        problem = error(slot_action(server, "save", "conv.bin"), 507)
        assert "no space left" in problem["message"] and problem["param"] == "filename"
        assert list(small_disk.iterdir()) == []
        complete(server, PROMPT, 4)
