"""TextStream: streamed deltas always add up to the whole text; stop sequences and split UTF-8."""

from __future__ import annotations

import pytest

from semkv.text_stream import TextStream

TEXT = "Hé 🎉 naïve — 日本語 ok. END here and more"


def pushed(tokenizer, text: str, stop=()) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, stop)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.finish())
    return deltas, stream


def test_deltas_add_up_and_never_split_a_character(tokenizer):
    deltas, stream = pushed(tokenizer, TEXT)
    assert "".join(deltas) == TEXT == stream.text
    assert not any("\ufffd" in d for d in deltas)  # the emoji and CJK bytes arrive across tokens


@pytest.mark.parametrize("stop", ["END", "d ", "ok. E", "日本", "🎉"])
def test_stop_sequence_cuts_and_is_never_sent(tokenizer, stop):
    deltas, stream = pushed(tokenizer, TEXT, [stop, "never-appears"])
    assert stream.stopped
    assert "".join(deltas) == TEXT[: TEXT.index(stop)] == stream.text


def test_partial_stop_prefix_is_released_at_the_end(tokenizer):
    """Text that might begin a stop sequence is held back, then sent when the generation ends."""
    deltas, stream = pushed(tokenizer, "alpha beta ST", ["STOP"])
    assert not stream.stopped and "".join(deltas) == "alpha beta ST"
    assert not "".join(deltas[:-1]).endswith("ST")
