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

from tokenizers.decoders import DecodeStream

from ..model.tokenizer import IncrementalDetokenizer, Tokenizer


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


class StreamDetokenizer:
    """Streams text token by token with `tokenizers`' DecodeStream (Rust): faster than the
    Python window decoder it replaced, with the same text after every token over 30k tokens of
    mixed scripts, emoji and random ids (benchmarks/detok.py, numbers in its README). A
    character split across tokens waits for its last byte."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=skip_special)
        self._num_pending = 0  # ids whose text has not come out (an unfinished character)
        self._num_chars = 0  # characters handed out

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self.ids.append(token_id)
        if not 0 <= token_id < self.tokenizer.vocab_size:
            return ""  # past the vocabulary (synthetic models): no text, as in Tokenizer.decode
        text = self._stream.step(self.tokenizer.backend, token_id)
        if text is None:
            self._num_pending += 1
            return ""
        self._num_pending = 0
        self._num_chars += len(text)
        return text

    def flush(self) -> str:
        """The text of an unfinished last character (U+FFFD), as a whole decode shows it; rare,
        so the whole decode it costs is paid once per sequence at most."""
        if not self._num_pending:
            return ""
        self._num_pending = 0
        text = self.tokenizer.decode(self.ids, self.skip_special)[self._num_chars:]
        self._num_chars += len(text)
        return text


def make_detokenizer(tokenizer: Tokenizer) -> StreamDetokenizer | IncrementalDetokenizer:
    """DecodeStream needs a `tokenizers` backend; a tokenizer without one (the unit tests' piece
    tables) gets the window decoder, which needs only `decode`."""
    if hasattr(tokenizer, "backend"):
        return StreamDetokenizer(tokenizer)
    return IncrementalDetokenizer(tokenizer)


class TextOutput:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._detok = make_detokenizer(tokenizer)
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


def token_piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """llama.cpp's piece: the token's text, or its bytes where they are not whole UTF-8."""
    text = tokenizer.token_text(token_id)
    if "\ufffd" not in text:
        return text
    raw = tokenizer.backend.id_to_token(token_id) or ""
    if all(ch in BYTE_LEVEL for ch in raw):  # byte-level BPE spells bytes as characters
        return [BYTE_LEVEL[ch] for ch in raw]
    return list(text.encode("utf-8"))


def byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> character table, character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


BYTE_LEVEL = byte_level_table()
