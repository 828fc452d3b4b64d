"""A sequence's text as it streams: incremental detokenization plus stop strings.

Text that could still turn out to be the start of a stop string is held back, so a client never
sees part of a stop string it asked to end on.
"""

from __future__ import annotations

from .model.tokenizer import IncrementalDetokenizer, Tokenizer


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """The new text that is safe to show after `token_id`; sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        self.text += self._detok.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """Whatever was held back, once the sequence has ended for another reason."""
        if self.stopped:
            return ""
        self.text += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        search_from = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        cut = min((i for s in self.stops if (i := self.text.find(s, search_from)) >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            end = cut
        else:
            end = len(self.text) if final else len(self.text) - _held_back(self.text, self.stops)
        end = max(end, self.emitted)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
