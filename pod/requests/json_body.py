"""A request body's bytes as a JSON object: refused with a 400 naming the body when it is empty,
not JSON, nested too deeply, holds more arrays and objects than any request needs, is not an
object, or holds a string that is not valid Unicode (a lone UTF-16 surrogate, named by its
path).

Decoding holds the GIL for its whole length, so while a body decodes no other thread (the event
loop answering /health included) runs. Its cost grows with the arrays and objects it makes, far
more than with the text: 600,000 two-element lists take ~0.2 s, 8 MiB of text ~10 ms. So they
are counted before decoding, in C over the bytes: with `MAX_CONTAINERS` and --max-body-bytes'
8 MiB, the slowest body to decode (dense numbers) takes about a tenth of a second."""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import ApiError, clip
from .errors import bad_field as _bad

# Arrays and objects one body may hold: more than any request needs (64 batched prompts, 4096
# messages with their parts and tool calls, 128 tools' schemas, 1024 logit_bias pairs).
MAX_CONTAINERS = 1 << 16
# A JSON string, escapes included, matched without backtracking: what to drop before counting
# the brackets outside strings
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
# Where a lone surrogate can come from: a \uD800-\uDFFF escape, or its UTF-8 bytes (json.loads
# decodes bytes with surrogatepass). Only a body that matches is walked.
_SURROGATE_HINT = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def decode_body(raw: bytes) -> dict[str, Any]:
    """JSON bytes -> the request object, or a 400 naming what is wrong. CPU-bound on a large
    body: call it off the event loop."""
    if not raw.strip():
        raise ApiError(400, "the body is empty; expected a JSON object", param="body")
    if count_containers(raw) > MAX_CONTAINERS:
        raise ApiError(400, f"the body holds more than {MAX_CONTAINERS} JSON arrays and objects",
                       param="body")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: it nests too deeply",
                       param="body") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", param="body") from None
    except ValueError:  # Python refuses integers past 4300 digits
        raise ApiError(400, "the body is not valid JSON: a number has too many digits",
                       param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", param="body")
    if _SURROGATE_HINT.search(raw):
        where = _lone_surrogate(body)
        if where is not None:
            raise _bad(where, "holds a lone UTF-16 surrogate (not valid Unicode text)")
    return body


def count_containers(raw: bytes) -> int:
    """The arrays and objects `raw` would decode to, or more: every bracket counts while that
    stays within the bound (strings' brackets too), and only past it are strings left out."""
    upper = raw.count(b"[") + raw.count(b"{")
    if upper <= MAX_CONTAINERS:
        return upper
    outside = _STRING.sub(b"", raw)
    return outside.count(b"[") + outside.count(b"{")


def decode_field_text(text: str, where: str) -> Any:
    """JSON text inside a field (tool-call arguments, a schema sent as text) -> its value, or a
    400 naming the field when it is not JSON or nests past what the decoder follows."""
    try:
        return json.loads(text)
    except RecursionError:
        raise _bad(where, "the JSON text nests too deeply") from None
    except ValueError as exc:  # JSONDecodeError, or an integer past 4300 digits
        raise _bad(where, f"not valid JSON text: {clip(str(exc))}") from None


def _lone_surrogate(value: Any) -> str | None:
    """The path of the first string (or key) that is not valid Unicode; None if all are."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:  # iterative: the nesting can be as deep as json allows
        item, where = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return where or "body"
        if isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, v in item.items():
                if not _is_text(key):
                    return where or "body"
                stack.append((v, f"{where}.{clip(key, 40)}" if where else clip(key, 40)))
    return None


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
