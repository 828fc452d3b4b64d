"""Two operator replicas with kopf peering: which one works (operator/peering.py), the random
priority each draws, and the resync loop that only the working one runs. kopf's own pausing is
kopf's; here only our half of it is checked, against the status kopf writes."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from kvpark.operator import handlers, kube, peering
from kvpark.operator.__main__ import get_kopf_args
from kvpark.operator.config import OperatorConfig

NOW = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.timezone.utc)


def peer(priority: int, seconds_ago: int, lifetime: int = 60) -> dict:
    seen = (NOW - datetime.timedelta(seconds=seconds_ago)).isoformat()
    return {"priority": priority, "lifetime": lifetime, "lastseen": seen}


def peering_object(*peers: dict) -> dict:
    return {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
            "metadata": {"name": "kvpark-operator"},
            "status": {f"pod-{i}@host": p for i, p in enumerate(peers)}}


def test_the_highest_live_priority_works() -> None:
    both = peering_object(peer(10, 5), peer(20, 5))
    assert peering.is_leader([both], 20, NOW)
    assert not peering.is_leader([both], 10, NOW)


def test_a_dead_peer_hands_over() -> None:
    """kopf's keep-alive stopped 61 s ago with a 60 s lifetime: the other replica takes over."""
    stale = peering_object(peer(10, 5), peer(20, 61))
    assert peering.is_leader([stale], 10, NOW)


def test_a_tie_pauses_both_as_kopf_does() -> None:
    tie = peering_object(peer(10, 5), peer(10, 5))
    assert not peering.is_leader([tie], 10, NOW)


def test_alone_or_before_the_first_keepalive() -> None:
    assert peering.is_leader([peering_object(peer(10, 1))], 10, NOW)
    assert peering.is_leader([peering_object()], 10, NOW)


def test_a_missing_peering_object_pauses() -> None:
    assert not peering.is_leader([None], 10, NOW)


def test_every_watched_namespace_must_agree() -> None:
    mine, theirs = peering_object(peer(30, 1)), peering_object(peer(30, 1), peer(40, 1))
    assert not peering.is_leader([mine, theirs], 30, NOW)
    assert peering.get_paths("p", ["a", "b"]) == [
        "/apis/kopf.dev/v1/namespaces/a/kopfpeerings/p",
        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings/p"]
    assert peering.get_paths("p", []) == ["/apis/kopf.dev/v1/clusterkopfpeerings/p"]


def test_kopf_timestamps_parse() -> None:
    # kopf writes datetime.isoformat() of an aware UTC time; other writers may use Z
    assert peering.parse_time("2026-12-01T12:00:00+00:00") == NOW
    assert peering.parse_time("2026-12-01T12:00:00Z") == NOW
    assert peering.parse_time("2026-12-01T12:00:00") == NOW


def test_each_start_draws_a_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    from kopf import cli

    from kvpark.operator import __main__

    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "main", lambda args, prog_name: seen.append(args))
    monkeypatch.setenv("KVPARK_PEERING", "kvpark-operator")
    for _ in range(3):
        __main__.main([])
    priorities = {next(a for a in args if a.startswith("--priority=")) for args in seen}
    assert len(priorities) == 3
    config = OperatorConfig.from_env({"KVPARK_PEERING": "kvpark-operator"})
    args = get_kopf_args(config, 5)
    assert "--peering=kvpark-operator" in args and "--standalone" not in args


def test_resync_runs_on_the_working_replica_only(monkeypatch: pytest.MonkeyPatch) -> None:
    config = dataclasses.replace(handlers.CONFIG, peering="kvpark-operator", namespaces=())
    monkeypatch.setattr(handlers, "CONFIG", config)
    now = datetime.datetime.now(datetime.timezone.utc)
    status = {"a@x": {"priority": 5, "lifetime": 60, "lastseen": now.isoformat()},
              "b@y": {"priority": 9, "lifetime": 60, "lastseen": now.isoformat()}}
    asked: list[str] = []

    def call(method: str, path: str, **_: object) -> dict:
        asked.append(f"{method} {path}")
        return {"status": status}

    monkeypatch.setattr(kube, "call", call)
    assert handlers.is_working(9) and not handlers.is_working(5)
    assert asked[0] == "GET /apis/kopf.dev/v1/clusterkopfpeerings/kvpark-operator"

    def refuse(method: str, path: str, **_: object) -> dict:
        raise kube.ApiError(403, "forbidden")

    monkeypatch.setattr(kube, "call", refuse)
    assert not handlers.is_working(9)  # unsure: pause rather than write beside another
    monkeypatch.setattr(handlers, "CONFIG", dataclasses.replace(config, peering=""))
    assert handlers.is_working(0)  # standalone asks nothing


def test_a_paused_replica_forgets_what_it_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf stops feeding a paused replica's watch: its bodies go stale, so the resync loop drops
    them and reconciles nothing until kopf lists the PreemptServers again."""
    import asyncio

    memory = handlers.Memory()
    memory.servers[("ns", "s")] = {"metadata": {"namespace": "ns", "name": "s"}}
    monkeypatch.setattr(handlers, "MEMORY", memory)
    reconciled: list[dict] = []
    monkeypatch.setattr(handlers, "reconcile", reconciled.append)
    rounds: list[int] = []

    def is_working(priority: int) -> bool:
        rounds.append(priority)
        return len(rounds) > 1  # paused for the first round, working after

    monkeypatch.setattr(handlers, "is_working", is_working)

    async def run() -> None:
        task = asyncio.create_task(handlers.resync_forever(0.01, 5))
        while memory.servers:  # the paused round drops what it saw
            await asyncio.sleep(0.005)
        assert reconciled == []
        memory.servers[("ns", "t")] = {"metadata": {"namespace": "ns", "name": "t"}}
        while not reconciled:  # kopf listed again: the working rounds reconcile that
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 10))
    assert reconciled[0]["metadata"]["name"] == "t"
    assert all(b["metadata"]["name"] != "s" for b in reconciled)
    assert set(rounds) == {5}  # asked with this replica's priority


def test_the_operator_makes_its_peering_object_once_the_crd_is_served(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf pauses every replica without the object; a CRD applied with the Deployment is served
    a moment later: 404s are asked again until the deadline, a 409 means it is there."""
    answers: list[object] = [None, None, {"metadata": {"name": "p"}}]
    asked: list[tuple[str, str, dict]] = []

    def call(method: str, path: str, body: dict | None = None, **_: object) -> object:
        asked.append((method, path, body))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(kube, "call", call)
    monkeypatch.setattr(handlers.time, "sleep", lambda seconds: None)
    handlers.ensure_peering("p", ())
    assert [(m, p) for m, p, _ in asked] == [("POST", "/apis/kopf.dev/v1/clusterkopfpeerings")] * 3
    assert asked[0][2]["kind"] == "ClusterKopfPeering" and asked[0][2]["metadata"]["name"] == "p"
    asked.clear()
    answers[:] = [kube.Conflict(409, "exists"), kube.Conflict(409, "exists")]
    handlers.ensure_peering("p", ("a", "b"))
    assert [p for _, p, _ in asked] == ["/apis/kopf.dev/v1/namespaces/a/kopfpeerings",
                                        "/apis/kopf.dev/v1/namespaces/b/kopfpeerings"]
    assert asked[1][2]["metadata"] == {"name": "p", "namespace": "b", "labels": {
        "app.kubernetes.io/name": "kvpark-operator", "app.kubernetes.io/part-of": "kvpark"}}


def test_a_peering_crd_never_served_is_said_and_left(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kube, "call", lambda *a, **k: None)  # 404 for ever
    with caplog.at_level("WARNING"):
        handlers.ensure_peering("p", (), wait_seconds=0)
    assert "kopf keeps this operator paused" in caplog.text
    monkeypatch.setattr(kube, "call", lambda *a, **k: (_ for _ in ()).throw(
        kube.ApiError(403, "forbidden")))
    handlers.ensure_peering("p", (), wait_seconds=0)  # a refusal is said, never raised
    assert "403 forbidden" in caplog.text
