"""The DecodeStream detokenizer streams exactly what the window decoder it replaced streamed."""

import random

import pytest

from kvpark.pod.core.text_output import StreamDetokenizer, TextOutput
from kvpark.pod.model.loader import builtin_tokenizer
from kvpark.pod.model.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return builtin_tokenizer()


def stream(detok, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_same_text_after_every_token(tok):
    rng = random.Random(7)
    text = "Grüße 🦙👩‍👩‍👧 我能吞下玻璃 <|im_end|> naïve café — ½"
    ids = tok.encode(text) + [rng.randrange(tok.vocab_size) for _ in range(300)]
    ours = stream(StreamDetokenizer(tok), ids)
    assert ours == stream(IncrementalDetokenizer(tok), ids)
    assert "".join(ours) == tok.decode(ids)
    assert "".join(stream(StreamDetokenizer(tok), tok.encode(text))) == text.replace(
        "<|im_end|>", "")  # special tokens are skipped


def test_a_split_character_waits_and_an_unfinished_one_flushes(tok):
    ids = tok.encode("🦙")
    assert len(ids) > 1  # the emoji's bytes span tokens
    detok = StreamDetokenizer(tok)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🦙"
    cut = StreamDetokenizer(tok)
    assert [cut.push(i) for i in [*tok.encode("ok"), ids[0]]][-1] == ""
    assert cut.flush() == "\ufffd"  # as a whole decode shows the unfinished character


def test_ids_past_the_vocabulary_render_nothing(tok):
    detok = StreamDetokenizer(tok)
    assert detok.push(tok.vocab_size + 5) == "" and detok.flush() == ""
    out = TextOutput(tok, ("STOP",))
    shown = "".join(out.push(i) for i in tok.encode("one two STOP three"))
    assert out.stopped and shown + out.finish() == "one two "
