"""A sequence's text as it streams: incremental detokenization plus stop strings.

Text that could still turn out to be the start of a stop string is held back, so a client never
sees part of a stop string it asked to end on.

The check runs on the engine thread once per token, so it only looks at the newly decoded
characters: each stop string has a KMP automaton that remembers how much of the stop string the
text ends with. The work per token is then about (new characters x stop strings), whatever the
length of the text or of the stop strings (a failure link followed is paid for by an earlier
character, so it is constant amortised).
"""

from __future__ import annotations

from .model.tokenizer import IncrementalDetokenizer, Tokenizer


def _failure(stop: str) -> list[int]:
    """KMP: fail[i] is the longest proper prefix of stop[:i + 1] that is also its suffix."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Finds stop strings in text that arrives piece by piece."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        assert all(stops), "stop strings must be non-empty"
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._matched = [0] * len(stops)  # per stop: how much of it the text ends with
        self.num_steps = 0  # automaton steps so far: the work done (tests read it)

    @property
    def held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max(self._matched, default=0)

    def feed(self, piece: str, can_stop: bool = True) -> int | None:
        """Append `piece`; if a stop string now occurs, how far before the end of `piece` the
        earliest one starts (it may start in text fed earlier), else None. With `can_stop`
        False (before min_tokens) an occurrence is passed over, as vLLM does."""
        back = None
        steps = 0
        for j, stop in enumerate(self.stops):
            fail, k = self._fail[j], self._matched[j]
            for i, ch in enumerate(piece):
                steps += 1
                while k and stop[k] != ch:
                    k = fail[k - 1]
                    steps += 1
                if stop[k] == ch:
                    k += 1
                if k == len(stop) and not can_stop:
                    k = fail[k - 1]
                elif k == len(stop):  # this stop's first occurrence: the others are later
                    start = len(piece) - 1 - i + len(stop)
                    back = start if back is None else max(back, start)
                    k = fail[k - 1]
                    break
            self._matched[j] = k
        self.num_steps += steps
        return back


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = StopMatcher(tuple(s for s in stops if s))
        self._emitted: list[str] = []  # pieces already handed out
        self._held = ""  # decoded, not handed out yet: it may be the start of a stop string
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything decoded so far (up to the stop string, once one matched)."""
        return "".join(self._emitted) + self._held

    @property
    def num_stop_steps(self) -> int:
        return self._stops.num_steps

    def push(self, token_id: int, can_stop: bool = True) -> str:
        """The new text that is safe to show after `token_id`; sets `stopped` on a stop string
        (only if `can_stop`: min_tokens not reached yet)."""
        if self.stopped:
            return ""
        return self._release(self._detok.push(token_id), final=False, can_stop=can_stop)

    def finish(self) -> str:
        """Whatever was held back, once the sequence has ended for another reason."""
        if self.stopped:
            return ""
        return self._release(self._detok.flush(), final=True)

    def _release(self, new_text: str, final: bool, can_stop: bool = True) -> str:
        held = self._held + new_text
        back = self._stops.feed(new_text, can_stop)
        if back is not None:
            # everything before a stop string's start was shown or is held, never more
            assert back <= len(held), f"a stop string starts {back} back in {len(held)} held"
            self.stopped = True
            end = len(held) - back
        else:  # what is held back was held before or is new: held_back <= len(held)
            end = len(held) if final else len(held) - self._stops.held_back
        delta, self._held = held[:end], "" if self.stopped else held[end:]
        if delta:
            self._emitted.append(delta)
        return delta
