"""vLLM's own KV event classes (`vllm/distributed/kv_events.py`), an outside consumer of
kvpark's KV events: read at test time from vLLM's wheel on PyPI, that one file only, by HTTP
range requests (a few hundred kilobytes of a 336 MB wheel; nothing of it is kept in the
checkout). Its imports from the rest of vLLM are stood in for by the little the event classes
need (the block hash type); everything a decoder uses is vLLM's code as published.
`vllm_kv_events()` skips the test where PyPI cannot be reached."""

from __future__ import annotations

import functools
import io
import logging
import sys
import types
import zipfile

import httpx
import pytest

VERSION = "0.33.0"
MEMBER = "vllm/distributed/kv_events.py"
SIMPLE = "https://pypi.org/simple/vllm/"
TIMEOUT = 30.0


class RangeReader(io.RawIOBase):
    """A remote file read by HTTP range requests: what `zipfile` needs to find one member."""

    def __init__(self, client: httpx.Client, url: str, size: int) -> None:
        self.client, self.url, self.size, self.pos = client, url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        response = self.client.get(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        response.raise_for_status()
        data = response.content[:end - self.pos]
        self.pos += len(data)
        return data

    def readinto(self, buffer) -> int:  # noqa: ANN001
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def wheel_file() -> tuple[str, int]:
    with httpx.Client(timeout=TIMEOUT) as client:
        listing = client.get(SIMPLE, headers={
            "Accept": "application/vnd.pypi.simple.v1+json"}).raise_for_status().json()
    for entry in listing["files"]:
        name = entry["filename"]
        if name.startswith(f"vllm-{VERSION}-") and name.endswith("x86_64.whl"):
            return entry["url"], entry["size"]
    raise LookupError(f"no vllm {VERSION} x86_64 wheel listed")


def stand_ins() -> dict[str, types.ModuleType]:
    """The modules kv_events.py imports from the rest of vLLM, with what the classes use."""
    modules = {}
    for name in ("vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.utils",
                 "vllm.utils.network_utils", "vllm.v1", "vllm.v1.core",
                 "vllm.v1.core.kv_cache_utils"):
        modules[name] = types.ModuleType(name)
    modules["vllm.config.kv_events"].KVEventsConfig = object
    modules["vllm.logger"].init_logger = logging.getLogger
    network = modules["vllm.utils.network_utils"]
    for helper in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
        setattr(network, helper, None)  # the publisher's, not the classes'
    modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int
    return modules


@functools.lru_cache(maxsize=1)
def _load() -> types.ModuleType:
    url, size = wheel_file()
    with httpx.Client(timeout=TIMEOUT) as client:
        reader = io.BufferedReader(RangeReader(client, url, size), buffer_size=1 << 16)
        with zipfile.ZipFile(reader) as wheel:
            source = wheel.read(MEMBER).decode()
    module = types.ModuleType("vllm.distributed.kv_events")
    # msgspec resolves the classes' annotations through their module, found by its name
    sys.modules[module.__name__] = module
    saved = {name: sys.modules.get(name) for name in stand_ins()}
    sys.modules.update(stand_ins())
    try:
        exec(compile(source, f"{url}!{MEMBER}", "exec"), module.__dict__)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def vllm_kv_events() -> types.ModuleType:
    try:
        return _load()
    except (httpx.HTTPError, LookupError, KeyError, zipfile.BadZipFile) as exc:
        pytest.skip(f"vLLM {VERSION}'s kv_events.py could not be read from PyPI: {exc}")
