"""A reasoning model's output: the text inside a think block (`<think>` ... `</think>`) is its
reasoning, the rest its answer, as llama-server's `--reasoning-format deepseek` and vLLM's
reasoning parsers split them.

The split is one state machine fed text in pieces (`ReasoningSplitter`), so a stream's deltas
and the whole answer come from the same rules whatever the pieces were: whitespace around the
block is dropped, and text that may still become a tag is held back until it does or cannot.
A whole output is the same machine fed once (`split_reasoning`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingRule:
    """How one request's output holds its reasoning (None on a request: no split at all)."""

    opened: bool  # the prompt ended inside a think block (the template opened it): output
    # starts in the reasoning; otherwise it starts there only if the model writes the tag
    keep_tags: bool = False  # deepseek-legacy: the content is the whole text, tags and all
    start: str = THINK_START
    end: str = THINK_END


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output had no think block, or an empty one
    content: str


class Phase(enum.Enum):
    PENDING = "pending"  # at the start: the model may yet open a block
    THINKING = "thinking"
    ANSWER = "answer"


def tag_prefix_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Text pieces in, (reasoning, content) pieces out; `finish` gives what was held back."""

    def __init__(self, rule: ThinkingRule) -> None:
        self.rule = rule
        self.phase = Phase.THINKING if rule.opened else Phase.PENDING
        self._held = ""  # undecided text: a possible tag, or whitespace that may be trimmed
        self._trim_leading = True  # the current part has shown no text yet
        self.saw_reasoning = False

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(final, reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def _step(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """One decision on the held text; True when another may follow at once."""
        if self.phase is Phase.PENDING:
            return self._pending(final)
        if self._trim_leading:
            self._held = self._held.lstrip()
            if not self._held:
                return False
            self._trim_leading = False
        if self.phase is Phase.ANSWER:
            content.append(self._held)
            self._held = ""
            return False
        return self._thinking(final, reasoning)

    def _pending(self, final: bool) -> bool:
        text = self._held.lstrip()
        if text.startswith(self.rule.start):
            self._held = text[len(self.rule.start):]
            self.phase, self._trim_leading = Phase.THINKING, True
            return True
        if not final and self.rule.start.startswith(text):
            return False  # only whitespace, or part of the tag, so far
        self.phase, self._trim_leading = Phase.ANSWER, False  # an answer keeps its whitespace
        return True

    def _thinking(self, final: bool, reasoning: list[str]) -> bool:
        end = self._held.find(self.rule.end)
        if end >= 0:
            self._emit_reasoning(self._held[:end].rstrip(), reasoning)
            self._held = self._held[end + len(self.rule.end):]
            self.phase, self._trim_leading = Phase.ANSWER, True
            return True
        if final:  # cut short inside the block (length, a budget without an end)
            self._emit_reasoning(self._held.rstrip(), reasoning)
            self._held = ""
            return False
        body = self._held[:len(self._held) - tag_prefix_length(self._held, self.rule.end)]
        shown = body.rstrip()  # trailing whitespace waits: it is dropped before the end tag
        self._emit_reasoning(shown, reasoning)
        self._held = self._held[len(shown):]
        return False

    def _emit_reasoning(self, text: str, reasoning: list[str]) -> None:
        if text:
            self.saw_reasoning = True
            reasoning.append(text)


def split_reasoning(text: str, rule: ThinkingRule | None) -> ReasoningSplit:
    """A whole output split by `rule` (None: all of it is content)."""
    if rule is None:
        return ReasoningSplit(None, text)
    splitter = ReasoningSplitter(rule)
    reasoning, content = splitter.push(text)
    more_reasoning, more_content = splitter.finish()
    reasoning += more_reasoning
    return ReasoningSplit(reasoning or None,
                          text if rule.keep_tags else content + more_content)
