"""Stop strings on streamed text: found across token boundaries, never shown in part, and
checked with work per token that grows with neither the text nor the stop strings' length."""

import random

import pytest

from kvpark.pod.core.text_output import TextOutput
from kvpark.pod.requests.errors import ApiError
from kvpark.pod.requests.fields import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kvpark.pod.requests.sampling_fields import sampling_params


class PieceTokenizer:
    """Token id i decodes to pieces[i]: just enough of `Tokenizer` for the detokenizer."""

    def __init__(self) -> None:
        self.pieces = ["a"]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return [self.pieces.index(text)]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids)

    def token(self, piece: str) -> int:
        self.pieces.append(piece)
        return len(self.pieces) - 1


def run(stops: tuple[str, ...], pieces: list[str]) -> tuple[list[str], TextOutput]:
    """What each token released (then what `finish` released), as the API streams it."""
    tok = PieceTokenizer()
    out = TextOutput(tok, stops)
    deltas = []
    for piece in pieces:
        deltas.append(out.push(tok.token(piece)))
        if out.stopped:
            break
    deltas.append(out.finish())
    return deltas, out


def test_a_stop_string_spanning_tokens_is_found_and_no_part_of_it_is_shown():
    deltas, out = run(("o wor",), ["Hel", "lo wo", "rld!", " more"])
    assert deltas == ["Hel", "l", "", ""]  # "o wo" is held back, then dropped with the stop
    assert out.stopped and out.text == "Hell"


def test_a_possible_stop_prefix_is_held_back_until_it_cannot_match():
    deltas, out = run(("END",), ["abc E", "N", "x", " y"])
    assert deltas == ["abc ", "", "ENx", " y", ""] and not out.stopped
    deltas, out = run(("END",), ["abc E", "N"])
    assert deltas == ["abc ", "", "EN"]  # the sequence ended otherwise: release what was held


def test_the_earliest_starting_stop_string_wins():
    deltas, out = run(("cd", "abcde"), ["x", "ab", "cde"])
    assert "".join(deltas) == out.text == "x"
    deltas, out = run(("abcdef", "cd"), ["x", "ab", "cdef"])
    assert out.text == "x"  # "cd" ends first, but "abcdef" starts first
    deltas, out = run(("aab",), ["a", "a", "a", "b"])  # a restart inside a partial match
    assert out.stopped and out.text == "a"


def expected_release(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """The definition, by brute force: up to the earliest stop, or all but the longest suffix
    that is a proper prefix of a stop string."""
    starts = [i for s in stops if (i := text.find(s)) >= 0]
    if starts:
        return text[:min(starts)], True
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[:len(text) - held], False


def test_streamed_release_matches_the_brute_force_definition():
    rng = random.Random(0)
    for _ in range(400):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(1, 7)))
                      for _ in range(rng.randrange(1, 4)))
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randrange(0, 5)))
                  for _ in range(rng.randrange(1, 12))]
        tok = PieceTokenizer()
        out = TextOutput(tok, stops)
        shown, seen = "", ""
        for piece in pieces:
            shown += out.push(tok.token(piece))
            seen += piece
            assert (shown, out.stopped) == expected_release(seen, stops), (stops, pieces)
            if out.stopped:
                break


def test_work_per_token_is_bounded_by_the_new_text_not_the_text_or_stop_length():
    """The reported case: 8 long stop strings that keep almost matching a long generation.
    Rescanning the text (or every prefix of every stop) per token is quadratic; the automata
    take at most two steps per new character and stop string, amortised."""
    rng = random.Random(1)
    stops = tuple("".join(rng.choice("ab") for _ in range(MAX_STOP_CHARS - 1)) + "c"
                  for _ in range(MAX_STOP_STRINGS))
    tok = PieceTokenizer()
    out = TextOutput(tok, stops)
    num_chars, steps_per_char = 0, []
    for _ in range(3000):
        piece = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 6)))
        before = out.num_stop_steps
        out.push(tok.token(piece))
        num_chars += len(piece)
        steps_per_char.append((out.num_stop_steps - before) / len(piece))
    assert not out.stopped
    assert out.num_stop_steps <= 2 * len(stops) * num_chars
    # no growth with the text: the last thousand tokens cost what the first thousand did
    late, early = sum(steps_per_char[-1000:]), sum(steps_per_char[:1000])
    assert late <= 1.5 * early


@pytest.mark.parametrize("stop", ["x" * (MAX_STOP_CHARS + 1), ["ok", "y" * 100_000]])
def test_stop_strings_longer_than_the_cap_are_refused_naming_stop(stop):
    with pytest.raises(ApiError) as err:
        sampling_params({"stop": stop}, 4096, ("max_tokens",))
    assert err.value.status == 400 and err.value.param == "stop"
    assert str(MAX_STOP_CHARS) in err.value.message


def test_a_stop_string_of_the_cap_is_accepted():
    stop = "x" * MAX_STOP_CHARS
    assert sampling_params({"stop": [stop]}, 4096, ("max_tokens",)).stop == (stop,)
