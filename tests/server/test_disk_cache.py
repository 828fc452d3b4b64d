"""The disk tier (--cache-disk) over real HTTP with real weights: greedy output is the same bytes
with it on and off; a conversation started on one server continues from cache on a second one
sharing the folder; SIGTERM in the middle of four conversations, then a restart: each next turn
is served from disk (>= 90% of its history) and says the same as an uninterrupted run; damaged,
truncated, foreign and half-written files are refused; a full disk costs the tier its writes
and nothing else; flags it cannot use exit 2 with one line."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from serverproc import ServerProcess, poll
from tmpfs import tmpfs

MODEL = "builtin://smollm2-135m"  # real weights: GGUF blocks for decode rows, fp32 prompt rows
FLAGS = ["-np", "4", "-c", "4096"]
ANSWER = 16  # tokens per answer: short beside the history, as a chat's next turn


def disk_server(folder, *flags: str) -> ServerProcess:
    return ServerProcess([*FLAGS, "--cache-disk", str(folder), *flags], model=MODEL)


def first_turn(n: int) -> list[dict]:
    words = " ".join(f"item{n}-{i}" for i in range(60))
    return [{"role": "user", "content": f"Conversation {n}. Keep these in mind: {words}"}]


def ask(server: ServerProcess, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def next_turn(messages: list[dict], answer: dict, n: int) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"][
        "content"]}, {"role": "user", "content": f"And what came after item{n}-7?"}]


def text(answer: dict) -> bytes:
    return answer["choices"][0]["message"]["content"].encode()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def history(answer: dict) -> int:
    """The tokens of the turn it answered: its prompt and its answer."""
    return answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]


def wait_written(server: ServerProcess) -> None:
    """Until the writer thread has published every page queued (written-through pages trail
    the response that filled them by a moment)."""
    poll(lambda: server.metric("kvpark:disk_cache_writes_total") > 0
         and server.metric("kvpark:disk_cache_queued_bytes") == 0, "pages written")


@pytest.fixture(scope="module")
def reference():
    """Two turns of four conversations on one server without a disk tier, never restarted."""
    with ServerProcess(FLAGS, model=MODEL) as server:
        turns = {}
        for n in range(4):
            first = ask(server, first_turn(n))
            turns[n] = (first, ask(server, next_turn(first_turn(n), first, n)))
        return turns


def test_two_servers_share_one_folder(reference, tmp_path):
    with disk_server(tmp_path) as one, disk_server(tmp_path) as two:
        first = ask(one, first_turn(1))
        wait_written(one)
        second = ask(two, next_turn(first_turn(1), first, 1))
        # the first turn's full prompt pages (its answer's were decode rows: not reused)
        assert cached(second) == first["usage"]["prompt_tokens"] // 16 * 16
        assert two.metric("kvpark:disk_cache_hits_total") * 16 == cached(second)
        assert two.metric("kvpark:prefix_cache_hits_total") == 0  # not its own pool's
        assert text(second) == text(reference[1][1])


def stream(server: ServerProcess, messages: list[dict], started: cf.Future) -> dict:
    """A streamed turn; `started` is set once its first token arrived. Returns the whole
    answer shaped as a chat completion."""
    body = {"messages": messages, "max_tokens": ANSWER, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    parts, usage = [], None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                parts.append(choice["delta"].get("content") or "")
                if parts[-1] and not started.done():
                    started.set_result(True)
    return {"choices": [{"message": {"content": "".join(parts)}}], "usage": usage}


@dataclass
class SigtermRun:
    folder: Path
    answers: list[dict]
    log: str
    exit_code: int


@pytest.fixture(scope="module")
def after_sigterm(tmp_path_factory) -> SigtermRun:
    """Four streamed conversations on a disk-tier server, SIGTERM once all four generate."""
    folder = tmp_path_factory.mktemp("disk")
    server = disk_server(folder).start()
    started = [cf.Future() for _ in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(stream, server, first_turn(n), started[n]) for n in range(4)]
        cf.wait(started)  # every conversation is generating
        code = server.stop(signal.SIGTERM, timeout=60)  # the drain finishes them
        answers = [future.result(timeout=60) for future in running]
    return SigtermRun(folder, answers, server.log(), code)


def copy_of(run: SigtermRun, tmp_path: Path) -> Path:
    """The folder as the run left it, for one test to use (and spoil)."""
    return Path(shutil.copytree(run.folder, tmp_path / "disk"))


def test_sigterm_mid_generation_drains_and_says_what_it_kept(after_sigterm, reference):
    assert after_sigterm.exit_code == 0
    assert after_sigterm.log.count("disk tier at shutdown") == 1
    for n, answer in enumerate(after_sigterm.answers):  # the tier on: the same bytes as off
        assert text(answer) == text(reference[n][0])


def test_after_a_restart_every_next_turn_comes_from_disk_with_the_same_text(
        after_sigterm, reference, tmp_path):
    with disk_server(copy_of(after_sigterm, tmp_path)) as restarted:
        turns, slots = [], []
        for n, answer in enumerate(after_sigterm.answers):
            started = cf.Future()
            with cf.ThreadPoolExecutor(1) as pool:
                running = pool.submit(stream, restarted, next_turn(first_turn(n), answer, n),
                                      started)
                cf.wait([started, running], return_when=cf.FIRST_COMPLETED)
                slots.append(restarted.slots())
                turns.append(running.result(timeout=60))
        from_disk = restarted.metric("kvpark:disk_cache_hits_total") * 16
        from_pool = restarted.metric("kvpark:prefix_cache_hits_total")
    assert [s["cached_from"] for s in slots[0] if s["is_processing"]] == [["disk"]]
    for n, (answer, turn) in enumerate(zip(after_sigterm.answers, turns)):
        assert cached(turn) >= 0.9 * history(answer), (n, cached(turn), history(answer))
        assert text(turn) == text(reference[n][1])
    # the system prompt's pages, read from disk once, are the pool's for the others
    assert from_disk + from_pool == sum(cached(turn) for turn in turns)
    assert from_disk >= 0.9 * sum(cached(turn) for turn in turns)


def damage(folder) -> dict[str, str]:
    """One file each: a flipped payload byte, a truncation, another model's header, and a
    temporary file of a writer that died; returns what was done to which name."""
    [identity_dir] = [p for p in folder.iterdir() if p.is_dir()]
    files = sorted(identity_dir.glob("*.kvpage"))
    flipped, cut, foreign = files[0], files[1], files[2]
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x55
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-1000])
    data = bytearray(foreign.read_bytes())
    data[12:44] = bytes(32)  # the identity digest of some other model
    foreign.write_bytes(bytes(data))
    dead = identity_dir / f".kvpark-{socket.gethostname()}-999999-x.tmp"
    dead.write_bytes(b"half a page")
    return {"flipped": flipped.name, "cut": cut.name, "foreign": foreign.name,
            "dead": dead.name}


def test_bad_files_are_refused_and_the_answers_are_still_right(after_sigterm, reference,
                                                                tmp_path):
    folder = copy_of(after_sigterm, tmp_path)
    names = damage(folder)
    [identity_dir] = [p for p in folder.iterdir() if p.is_dir()]
    bad = {name: (identity_dir / name).read_bytes() for name in names.values()}
    with disk_server(folder) as server:
        for n, answer in enumerate(after_sigterm.answers):  # every chain: each bad file's too
            turn = ask(server, next_turn(first_turn(n), answer, n))
            assert text(turn) == text(reference[n][1])
        assert server.metric("kvpark:disk_cache_rejected_total") >= 1  # a chain's first bad
        log = server.log()
        assert "temporary files of writers that died" in log
    assert not (identity_dir / names["dead"]).exists()
    refused = [name for name in (names["flipped"], names["cut"], names["foreign"])
               if f"{name} refused and removed" in log]
    assert refused
    for name in refused:  # gone, or written again from the K/V computed in its place
        path = identity_dir / name
        assert not path.exists() or path.read_bytes() != bad[name]


def test_a_full_disk_stops_the_writes_with_one_line_and_nothing_fails(reference, tmp_path):
    with tmpfs(tmp_path / "small", "2m") as mount, disk_server(mount) as server:
        first = ask(server, first_turn(3))
        poll(lambda: server.metric("kvpark:disk_cache_writable") == 0, "the disk filled")
        again = ask(server, next_turn(first_turn(3), first, 3))
        assert text(first) == text(reference[3][0])
        assert text(again) == text(reference[3][1])
        assert server.count_in_log("is full") == 1


@pytest.mark.parametrize("flags, says", [
    (["--cache-disk", "{file}"], "--cache-disk {file}: not a directory"),
    (["--cache-disk", "{dir}", "--no-prefix-cache"], "--cache-disk needs the prefix cache"),
    (["--cache-disk", "{dir}", "--cache-disk-size", "0"], "expected GiB > 0"),
])
def test_a_disk_tier_it_cannot_use_is_one_line_and_exit_2(tmp_path, flags, says):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    fill = {"file": str(a_file), "dir": str(tmp_path / "d")}
    argv = [sys.executable, "-m", "kvpark.pod", "--port", "0", "--model", "synthetic:tiny",
            *[f.format(**fill) for f in flags]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert says.format(**fill) in done.stderr
    assert "Traceback" not in done.stderr


# ---- a hybrid model: its state checkpoints go to disk beside its pages -------------------------
def hybrid_server(*flags: str) -> ServerProcess:
    """Dense linears: a generated token's page is then the next turn's prompt page too."""
    return ServerProcess(["-np", "2", "--weights", "fp32", *flags], model="synthetic:tiny-hybrid")


def complete(server: ServerProcess, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    response = server.post("/completion", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_hybrids_next_turn_after_a_restart_starts_from_a_checkpoint_on_disk(tmp_path):
    turn1 = list(range(100, 180))
    with hybrid_server() as server:  # the reference: never restarted, no disk tier
        first = complete(server, turn1)
        turn2 = turn1 + first["tokens"] + list(range(300, 320))
        expected = complete(server, turn2)
    with hybrid_server("--cache-disk", str(tmp_path)) as server:
        assert complete(server, turn1)["tokens"] == first["tokens"]
        wait_written(server)
        assert list(tmp_path.glob("*/*.kvstate"))  # the turn's checkpoint, written through
    with hybrid_server("--cache-disk", str(tmp_path)) as server:
        again = complete(server, turn2)
        assert again["tokens"] == expected["tokens"]
        assert again["timings"]["cache_n"] >= len(turn1) // 16 * 16
        assert server.metric("kvpark:state_checkpoint_hits_total") == 1
        assert server.metric("kvpark:disk_cache_hits_total") > 0
