"""vLLM's KV event publisher, for kvpark's events (`memory/kv_events.py`): `--kv-events-config`
takes vLLM's JSON (`enable_kv_cache_events`, `publisher: zmq`, `endpoint`, `replay_endpoint`,
`buffer_steps`, `hwm`, `max_queue_size`, `topic`), so a vLLM deployment's setting carries over.

The wire format is vLLM's: each step's events as one msgpack batch `[ts, events, dp_rank]`,
each event a map tagged by its `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), sent
on a ZMQ PUB socket as `(topic, sequence number as 8 bytes big-endian, payload)`. The last
`buffer_steps` batches are kept for a subscriber that missed some: it sends a ROUTER socket at
`replay_endpoint` the first sequence number it wants (8 bytes) and gets each kept batch from
there, then `(-1, b"")`.

Encoding and sending run on the publisher's own thread; the engine only puts a step's events
on its queue. When the queue is full (the thread far behind) a batch is dropped, counted and
logged once: the engine never waits on a subscriber.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from ..args import json_object
from ..memory.kv_events import AllCleared, BlocksRemoved, BlocksStored, KvEvent, KvEventLog

log = logging.getLogger("kvpark.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
POLL_SECONDS = 0.1


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig keys, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" publishes; "null" records nothing
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_config(text: str) -> KvEventsConfig:
    """--kv-events-config's JSON, checked key by key (ValueError names the problem)."""
    raw = json_object(text)
    known = {f.name: f for f in fields(KvEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
    defaults = KvEventsConfig()
    for name, value in raw.items():
        expected = type(getattr(defaults, name))
        if name == "replay_endpoint" and value is None:
            continue
        if type(value) is not (str if name == "replay_endpoint" else expected):
            raise ValueError(f"{name}: expected a {expected.__name__}, got {value!r}")
    config = KvEventsConfig(**raw)
    if config.publisher not in ("null", "zmq"):
        raise ValueError(f"publisher: 'zmq' or 'null', got {config.publisher!r}")
    if min(config.buffer_steps, config.hwm, config.max_queue_size) < 1:
        raise ValueError("buffer_steps, hwm and max_queue_size must be positive")
    return config


def _wire_types() -> tuple[Any, ...]:
    """msgspec structs laid out as vLLM's (imported here: only a publishing server needs
    msgspec)."""
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(Event):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared, msgspec.msgpack.Encoder()


class ZmqEventPublisher:
    """A PUB socket (and a ROUTER for replays) served by one thread."""

    def __init__(self, config: KvEventsConfig) -> None:
        import zmq  # only a publishing server needs pyzmq

        self.config = config
        self.num_dropped = 0  # batches the full queue turned away
        self.num_sent = 0
        self._queue: queue.Queue[tuple[float, list[KvEvent]] | None] = queue.Queue(
            config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:  # bound or connected here, so a taken port fails the start with one line
            self._attach(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: {exc} ({config.endpoint}"
                             f"{', ' + config.replay_endpoint if self._replay else ''})") from None
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="kvpark-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s%s (topic %r)", config.endpoint,
                 f", replays on {config.replay_endpoint}" if config.replay_endpoint else "",
                 config.topic)

    @staticmethod
    def _attach(socket: Any, endpoint: str) -> None:
        # vLLM's rule: a wildcard or local endpoint is bound, a remote one connected to
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)

    def publish(self, events: list[KvEvent]) -> None:
        """A step's events (engine thread): queued, never waited on."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                log.warning("KV events: the publisher fell %d batches behind; dropping batches "
                            "(a router's view of this server may be stale until it replays)",
                            self.config.max_queue_size)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    def _run(self) -> None:
        batch_type, stored, removed, cleared, encoder = _wire_types()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            wire = [self._to_wire(e, stored, removed, cleared) for e in events]
            payload = encoder.encode(batch_type(ts, wire, 0))
            number = seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, number, payload))
            except Exception:  # a broken socket must not end the thread
                log.exception("KV events: sending batch %d failed", seq)
            self._kept.append((seq, payload))
            self.num_sent += 1
            seq += 1

    @staticmethod
    def _to_wire(event: KvEvent, stored: Any, removed: Any, cleared: Any) -> Any:
        if isinstance(event, BlocksStored):
            return stored(list(event.hashes), event.parent, list(event.token_ids),
                          event.block_size, None, event.medium, None)
        if isinstance(event, BlocksRemoved):
            return removed(list(event.hashes), event.medium)
        assert isinstance(event, AllCleared)
        return cleared()

    def _serve_replay(self) -> None:
        """One replay request: the kept batches from the sequence number asked for."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, first = frames
        start = int.from_bytes(first, "big")
        for number, payload in list(self._kept):
            if number >= start:
                self._replay.send_multipart((client, b"", number.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


@dataclass(frozen=True)
class KvEventOutlet:
    """Where the engine's KV events go: recorded by the memory layer, drained after each
    step into the publisher's queue."""

    log: KvEventLog
    publisher: ZmqEventPublisher

    def flush(self) -> None:
        events = self.log.drain()
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        self.publisher.close()
