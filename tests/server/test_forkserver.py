"""The suite's fork server (forkserver.py) gives the tests what a fresh `python -m kvpark.pod`
gives them: the same bytes, exit codes the test process reaps, and a fresh interpreter where
the environment would change what the imports read."""

import signal

import pytest
from forkserver import AdoptedProcess, enabled, fork_server
from serverproc import ServerProcess

pytestmark = pytest.mark.skipif(not enabled(), reason="fork server off (KVPARK_TEST_FORKSERVER)")
GREEDY = {"prompt": "The fork server", "n_predict": 24, "temperature": 0, "ignore_eos": True,
          "return_tokens": True}


def test_a_forked_server_answers_as_a_fresh_interpreter_does():
    answers = []
    for fresh in (True, False):
        with ServerProcess(["-np", "2", "-c", "1024"], fresh_interpreter=fresh) as server:
            assert isinstance(server.proc, AdoptedProcess) != fresh
            response = server.post("/completion", GREEDY)
            assert response.status_code == 200, response.text
            answers.append(response.json())
    fresh_answer, forked_answer = answers
    assert forked_answer["tokens"] == fresh_answer["tokens"]
    assert forked_answer["content"].encode() == fresh_answer["content"].encode()


def test_the_test_process_reaps_a_forked_server_and_reads_its_exit_code():
    server = ServerProcess(["-np", "2", "-c", "1024"]).start()
    assert isinstance(server.proc, AdoptedProcess)
    assert server.proc.poll() is None
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0
    server.stop()

    refused = ServerProcess(["-np", "2", "-c", "1024", "--no-such-flag"])
    with pytest.raises(RuntimeError, match="server exited 2"):
        refused.start()
    assert isinstance(refused.proc, AdoptedProcess)
    assert "unrecognized arguments: --no-such-flag" in refused.log()


def test_an_environment_that_imports_read_gets_a_fresh_interpreter():
    assert ServerProcess([], env={"KVPARK_SEED": "7"}).forked()
    assert not ServerProcess([], env={"OMP_NUM_THREADS": "2"}).forked()
    assert not ServerProcess([], env={"ONEDNN_MAX_CPU_ISA": "AVX2"}).forked()
    assert not ServerProcess([], fresh_interpreter=True).forked()


def test_a_change_to_the_test_process_s_import_time_environment_gets_a_new_fork_server(
        monkeypatch):
    """An in-process test may leave such a variable changed for the rest of the process: the
    servers after it still fork, from a fork server that imported with it."""
    with ServerProcess(["-np", "2", "-c", "1024"]) as before:
        first = fork_server(before.base_environment())
        assert isinstance(before.proc, AdoptedProcess)
    monkeypatch.setenv("ONEDNN_VERBOSE", "0")
    with ServerProcess(["-np", "2", "-c", "1024"]) as after:
        assert isinstance(after.proc, AdoptedProcess)
        assert fork_server(after.base_environment()) is not first
        assert after.post("/completion", GREEDY).status_code == 200
