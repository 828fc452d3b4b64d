"""A JSON text read as far as it goes: what `max_tokens` left of constrained output.

The grammar keeps the output a prefix of valid JSON, so a cut-short text is a tree whose last
branch is open. `parse_prefix` returns that tree with each node's span in the text and whether
it closed, so a caller can take whole values where they are whole and the text so far where
they are not (a tool call's arguments, as OpenAI returns a call cut short).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = " \t\n\r"
SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
HIGH_SURROGATES = ("\ud800", "\udbff")  # the first half of a pair, its second half cut off


@dataclass
class Node:
    kind: str  # object, array, string, scalar
    start: int  # where the value begins in the text
    end: int = -1  # one past its last character; the text's end while not complete
    complete: bool = False
    text: str = ""  # a string's characters so far, decoded
    members: dict[str, Node] = field(default_factory=dict)  # object
    items: list[Node] = field(default_factory=list)  # array

    def value(self, source: str) -> Any:
        """The Python value of a complete node."""
        assert self.complete
        return json.loads(source[self.start:self.end], strict=False)


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    @property
    def at_end(self) -> bool:
        self.skip_whitespace()
        return self.pos >= len(self.text)

    def skip_whitespace(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos]

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at {self.pos}, found {self.peek()!r}")
        self.pos += 1

    def value(self) -> Node:
        char = self.peek()
        if char == "{":
            return self.container(Node("object", self.pos), "}")
        if char == "[":
            return self.container(Node("array", self.pos), "]")
        if char == '"':
            return self.string()
        return self.scalar()

    def container(self, node: Node, closer: str) -> Node:
        self.pos += 1
        first = True
        while not self.at_end:
            if self.peek() == closer:
                self.pos += 1
                return self.closed(node)
            if not first:
                self.expect(",")
                if self.at_end:
                    break
            first = False
            if not self.member(node):
                break
        node.end = len(self.text)
        return node

    def member(self, node: Node) -> bool:
        """One member (object) or item (array); False where the text ends inside it."""
        if node.kind == "object":
            key = self.string()
            if not key.complete or self.at_end:
                return False
            self.expect(":")
            if self.at_end:
                return False
            child = node.members[key.text] = self.value()
        else:
            child = self.value()
            node.items.append(child)
        return child.complete

    def string(self) -> Node:
        node = Node("string", self.pos)
        self.expect('"')
        i = self.pos
        while i < len(self.text):
            if self.text[i] == "\\":
                i += 2
                continue
            if self.text[i] == '"':
                self.pos = i + 1
                node.text = json.loads(self.text[node.start:self.pos], strict=False)
                return self.closed(node)
            i += 1
        so_far = json.loads(f'"{whole_escapes(self.text[node.start + 1:])}"', strict=False)
        if so_far and HIGH_SURROGATES[0] <= so_far[-1] <= HIGH_SURROGATES[1]:
            so_far = so_far[:-1]  # half a character cannot be sent as UTF-8
        node.text = so_far
        self.pos = node.end = len(self.text)
        return node

    def scalar(self) -> Node:
        node = Node("scalar", self.pos)
        while self.pos < len(self.text) and self.text[self.pos] in SCALAR_CHARS:
            self.pos += 1
        if self.pos == node.start:
            raise ValueError(f"unexpected {self.peek()!r} at {self.pos}")
        if self.pos == len(self.text):  # `12` or `tr` at the end may go on
            node.end = self.pos
            return node
        return self.closed(node)

    def closed(self, node: Node) -> Node:
        node.end, node.complete = self.pos, True
        return node


def whole_escapes(raw: str) -> str:
    """A string's raw characters without an escape the text ends inside of (`\\`, `\\u00`)."""
    i = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
            continue
        length = 6 if raw[i + 1:i + 2] == "u" else 2
        if i + length > len(raw):
            return raw[:i]
        i += length
    return raw


def parse_prefix(text: str) -> Node | None:
    """The tree of a JSON text or of a prefix of one; None for blank text. ValueError where the
    text is not (a prefix of) JSON, or goes on after a complete value."""
    reader = _Reader(text)
    if reader.at_end:
        return None
    root = reader.value()
    if root.complete and not reader.at_end:
        raise ValueError(f"text after the JSON value at {reader.pos}")
    return root
