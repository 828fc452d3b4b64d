"""Stored responses (`/v1/responses` with `store`, the default): each response's conversation as
chat messages, so a request naming it as `previous_response_id` continues from there. Bounded in
memory (responses and characters), least recently used dropped first; lost on restart, as
llama-server's and vLLM's stores are.

Written by the event loop when a response ends and read by the parser threads: one lock, and
the stored lists are never changed after `put` (a continuation copies them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

MAX_RESPONSES = 1024
MAX_CHARS = 64 << 20  # of message text, summed over the stored conversations


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[tuple[dict[str, Any], ...], int]] = OrderedDict()
        self._chars = 0

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                return None
            self._items.move_to_end(response_id)
            return [dict(m) for m in found[0]]

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        size = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or ""))
                   for m in conversation)
        with self._lock:
            self._items[response_id] = (tuple(conversation), size)
            self._chars += size
            while self._items and (len(self._items) > self.max_responses
                                   or self._chars > self.max_chars):
                _, (_, dropped) = self._items.popitem(last=False)
                self._chars -= dropped

    def __len__(self) -> int:
        return len(self._items)
