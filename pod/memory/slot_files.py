"""Slot files (`--slot-save-path DIR`, llama-server's `POST /slots/{id}?action=save|restore`):
which names may be used inside DIR, and the file format.

A file holds one slot's saveable state (`SlotState`: the tokens of whole KV pages and those
pages' bytes; for a hybrid model also the DeltaNet state after the last of them, its state
checkpoint) after a header naming the model and the KV layout that computed them, so a server
with other weights, another dtype or another page or state layout refuses it instead of
continuing from K/V it would misread. Layout, all little-endian:

    MAGIC (8 bytes) | version u32 | header length u32 | header (JSON, UTF-8)
    | tokens (int64 x num_tokens) | pages (the pool's dtype, [layers, pages, 2, page_size, Hkv, D])
    | state (`state_bytes` bytes: the state slot's parts as `StatePool.read` lays them out; none
      for a model without state slots) | SHA-256 of everything before it (32 bytes)

The digest catches a corrupted file, the size read from the header a truncated one. Names are
plain file names resolved inside DIR (no separators, no `..`, no leading dot, no symlink that
leads out); a save writes a temporary file beside the target and renames it over, so a reader
never sees half a file. Everything here runs off the event loop and off the engine thread.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .identity import ModelIdentity
from .state_pool import StatePart, split_state

MAGIC = b"KVPSLOT\0"
VERSION = 1
MAX_NAME_BYTES = 255  # a file name's limit on common file systems
MAX_HEADER_BYTES = 1 << 20
_PREFIX = struct.Struct("<8sII")
_DIGEST_BYTES = 32


class SlotFileError(Exception):
    """A name or a file that cannot be used; `status` is the HTTP status the API answers."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SlotState:
    """A slot's saveable state, copied out of the pool on the engine thread."""

    tokens: tuple[int, ...]  # of whole pages: len(tokens) == pages x page_size
    num_prompt: int  # of them, rows computed as prompt (the page hashes tell the kinds apart)
    kv: torch.Tensor  # [layers, pages, 2, page_size, Hkv, D] on the CPU
    state: torch.Tensor | None = None  # a hybrid's state after the last page (flat uint8)

    @property
    def state_bytes(self) -> int:
        return 0 if self.state is None else self.state.numel()

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]


# ---- names --------------------------------------------------------------------------------
def resolve_name(directory: str, name: object) -> Path:
    """The path of `name` inside `directory`, or SlotFileError naming what is wrong with it."""
    if not isinstance(name, str) or not name:
        raise SlotFileError("'filename': expected a non-empty file name")
    if len(name.encode()) > MAX_NAME_BYTES:
        raise SlotFileError(f"'filename': longer than {MAX_NAME_BYTES} bytes")
    if "/" in name or "\\" in name or name.startswith(".") or any(ord(c) < 32 for c in name):
        raise SlotFileError("'filename': expected a plain file name inside --slot-save-path "
                            "(no path separators, no leading dot, no control characters)")
    root = Path(directory).resolve()
    path = (root / name).resolve()  # follows symlinks: one leading out of DIR is refused
    if path.parent != root:
        raise SlotFileError("'filename': resolves outside --slot-save-path")
    return path


# ---- writing ------------------------------------------------------------------------------
def encode(identity: ModelIdentity, state: SlotState) -> list[bytes]:
    header = json.dumps({"identity": asdict(identity), "num_tokens": len(state.tokens),
                         "num_prompt": state.num_prompt, "num_pages": state.num_pages,
                         "kv_shape": list(state.kv.shape),
                         "state_bytes": state.state_bytes}).encode()
    tokens = torch.tensor(state.tokens, dtype=torch.int64).numpy().tobytes()
    pages = state.kv.contiguous().view(torch.uint8).numpy().tobytes()
    parts = [_PREFIX.pack(MAGIC, VERSION, len(header)), header, tokens, pages]
    if state.state is not None:
        parts.append(state.state.contiguous().numpy().tobytes())
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return [*parts, digest.digest()]


def write(path: Path, identity: ModelIdentity, state: SlotState) -> int:
    """Write the file atomically (a temporary file renamed over the target); its size. A full
    disk is a 507, a name taken by a directory a 409; no partial file is left either way."""
    if path.is_dir():
        raise SlotFileError(f"'filename': {path.name!r} is a directory in --slot-save-path", 409)
    parts = encode(identity, state)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            for part in parts:
                file.write(part)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _write_error(path, exc) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return sum(len(part) for part in parts)


def _write_error(path: Path, exc: OSError) -> SlotFileError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return SlotFileError(f"no space left in --slot-save-path for {path.name!r}", 507)
    if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
        return SlotFileError(f"'filename': {path.name!r} is a directory in --slot-save-path",
                             409)
    return SlotFileError(f"the slot file could not be written: {exc.strerror or exc}", 500)


# ---- temporary files left by a writer that died ----------------------------------------
TEMP_SUFFIX = ".tmp"
STALE_SECONDS = 3600  # another host's temporary file untouched this long: its writer is gone


def temp_prefix() -> str:
    """`.kvpark-HOST-PID-`: which process a temporary file is from, so a restart can tell its
    own dead predecessors' files from a live writer's (a directory may be shared by pods)."""
    return f".kvpark-{socket.gethostname()}-{os.getpid()}-"


def remove_stale_temp_files(directory: str) -> list[str]:
    """At start: delete the temporary files of saves that never finished (a writer killed
    mid-save); the names removed. Another live process's files are left alone."""
    removed, now, host = [], time.time(), socket.gethostname()
    for path in Path(directory).glob(f".*{TEMP_SUFFIX}"):
        try:
            if _is_stale(path.name, path.stat().st_mtime, now, host):
                path.unlink()
                removed.append(path.name)
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    return removed


def _is_stale(name: str, mtime: float, now: float, host: str) -> bool:
    match = re.fullmatch(r"\.kvpark-(.+)-(\d+)-[^-]*" + re.escape(TEMP_SUFFIX), name)
    if match and match[1] == host:
        pid = int(match[2])
        return pid == os.getpid() or not _is_alive(pid)  # the same pid: an earlier life's
    return now - mtime > STALE_SECONDS


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


# ---- reading ------------------------------------------------------------------------------
def read(path: Path, identity: ModelIdentity, dtype: torch.dtype,
         state_layout: tuple[StatePart, ...] = ()) -> tuple[SlotState, int]:
    """The state a file holds and the file's size; SlotFileError when it is missing, not a slot
    file, damaged, or from another model or KV layout. The header is checked before the rest is
    read, so a wrong file costs no more than its header. `state_layout`: the state slot's parts
    (a hybrid model's; empty for others)."""
    if not path.is_file():
        raise SlotFileError(f"'filename': no slot file {path.name!r} in --slot-save-path", 404)
    try:
        return _read(path, identity, dtype, state_layout)
    except OSError as exc:
        raise SlotFileError(f"the slot file could not be read: {exc.strerror or exc}",
                            500) from None


def _read(path: Path, identity: ModelIdentity, dtype: torch.dtype,
          state_layout: tuple[StatePart, ...]) -> tuple[SlotState, int]:
    with path.open("rb") as file:
        size = os.fstat(file.fileno()).st_size
        data = bytearray(file.read(_PREFIX.size + MAX_HEADER_BYTES))
        header, body_at = _read_header(data)
        different = identity.differences(saved_identity(header))
        if different:
            raise SlotFileError("the slot file was saved by a different model or KV layout: "
                                + "; ".join(different))
        num_tokens, num_prompt, shape = _sizes(header, identity)
        kv_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        state_bytes = _state_bytes(header, state_layout)
        expected = body_at + 8 * num_tokens + kv_bytes + state_bytes + _DIGEST_BYTES
        if size != expected:
            what = "truncated" if size < expected else "longer than its header says"
            raise SlotFileError(f"the slot file is {what} ({size} bytes, {expected} expected)")
        data += file.read()
    view = memoryview(data)
    if len(data) != size or hashlib.sha256(view[:-_DIGEST_BYTES]).digest() != view[-_DIGEST_BYTES:]:
        raise SlotFileError("the slot file is corrupted (its SHA-256 does not match)")
    tokens = torch.frombuffer(data, dtype=torch.int64, count=num_tokens, offset=body_at)
    kv = torch.frombuffer(data, dtype=torch.uint8, count=kv_bytes, offset=body_at + 8 * num_tokens)
    kv = kv.view(dtype).reshape(shape)
    check_finite(kv)
    state = None
    if state_layout:
        state = torch.frombuffer(data, dtype=torch.uint8, count=state_bytes,
                                 offset=body_at + 8 * num_tokens + kv_bytes)
        for part in split_state(state, state_layout):
            check_finite(part)
    return SlotState(tuple(tokens.tolist()), num_prompt, kv, state), size


def _read_header(data: bytes) -> tuple[dict, int]:
    """The header and where the tokens start."""
    if len(data) < _PREFIX.size or data[:8] != MAGIC:
        raise SlotFileError("not a kvpark slot file (wrong magic bytes)")
    _, version, header_len = _PREFIX.unpack_from(data)
    if version != VERSION:
        raise SlotFileError(f"slot file format version {version}; this server reads {VERSION}")
    if header_len > MAX_HEADER_BYTES or len(data) < _PREFIX.size + header_len:
        raise SlotFileError("the slot file is truncated (its header is cut short)")
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len])
    except (ValueError, RecursionError):  # RecursionError: nested deeper than any header
        header = None
    if not isinstance(header, dict):
        raise SlotFileError("the slot file is corrupted (its header is not a JSON object)")
    return header, _PREFIX.size + header_len


def saved_identity(header: dict) -> dict[str, object]:
    """The header's model identity: an object of names to plain values, as `encode` writes."""
    saved = header.get("identity")
    if not isinstance(saved, dict) or not all(
            isinstance(v, (str, int, float, bool)) for v in saved.values()):
        raise SlotFileError("the slot file is corrupted (its model identity is not an object of "
                            "plain values)")
    return saved


def _count(header: dict, name: str) -> int:
    value = header.get(name)
    if type(value) is not int or value < 0:
        raise SlotFileError(f"the slot file is corrupted (its header's {name!r} is not a count)")
    return value


def _sizes(header: dict, identity: ModelIdentity) -> tuple[int, int, tuple[int, ...]]:
    """Tokens, prompt rows and the pages' shape, checked against each other and the layout."""
    num_tokens, num_prompt = _count(header, "num_tokens"), _count(header, "num_prompt")
    shape = header.get("kv_shape")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise SlotFileError("the slot file is corrupted (its header's 'kv_shape' is not a list "
                            "of sizes)")
    ps = identity.page_size
    layout = (identity.num_layers, 2, ps, identity.num_kv_heads, identity.head_dim)
    if (len(shape) != 6 or (shape[0], *shape[2:]) != layout or shape[1] * ps != num_tokens
            or not num_prompt <= num_tokens):
        raise SlotFileError("the slot file is corrupted (its sizes do not fit together)")
    if shape[1] == 0:
        raise SlotFileError("the slot file holds no pages")
    return num_tokens, num_prompt, tuple(shape)


def _state_bytes(header: dict, layout: tuple[StatePart, ...]) -> int:
    """The state's size: a hybrid model's file carries exactly one state slot, others none (the
    identity's `state_layout` already said which layout; this checks the header agrees)."""
    expected = sum(part.num_bytes for part in layout)
    if header.get("state_bytes", 0) != expected:
        raise SlotFileError("the slot file is corrupted (its header's 'state_bytes' is not "
                            f"this server's state slot, {expected} bytes)")
    return expected


def check_finite(kv: torch.Tensor) -> None:
    """K/V (or state) a model can have written: a NaN or an infinity there would poison every
    request that shares these tokens. A file with a valid digest can still hold them (written
    by hand)."""
    if kv.is_floating_point() and not bool(torch.isfinite(kv).all()):
        raise SlotFileError("the slot file holds K/V or state values that are not finite (NaN "
                            "or infinite): not what a model writes")
