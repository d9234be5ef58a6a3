"""TextStream: streamed deltas always add up to the whole text; stop sequences and split UTF-8."""

from __future__ import annotations

import random

import pytest

from semkv.request import MAX_STOP_CHARS, GenerateRequest
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


class CountingTokenizer:
    """A tokenizer whose ``decode`` records how many token ids each call decoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_a_tokens_cost_does_not_grow_with_the_output(tokenizer):
    """Each push decodes a window of a few tokens, not the whole output (the old stream decoded every
    token so far on every push: 2,000 ids at the 2,000th token), and stops of the longest allowed length
    are matched by their streaming matchers."""
    text = "The keeper wrote: 日本語 ok, naïve 🎉. " * 150
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1500
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, ["q" * MAX_STOP_CHARS] * 4)
    deltas = []
    for token in ids:
        counting.decoded.clear()
        deltas.append(stream.push(token))
        assert sum(counting.decoded) <= 16, counting.decoded
    deltas.append(stream.finish())
    assert "".join(deltas) == text == stream.text and not stream.stopped


def reference_cut(text_after: list[str], stops: list[str]) -> str:
    """The stop rule, naively: after each token, the text so far up to the earliest stop found in it."""
    for text in text_after:
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)]
    return text_after[-1] if text_after else ""


@pytest.mark.parametrize("seed", range(40))
def test_stops_match_the_naive_rule(tokenizer, seed):
    """Random texts over a small alphabet and random (overlapping, self-similar) stops: the stream cuts
    where the naive rule does, and never sends text it later takes back."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab a") for _ in range(rng.randint(5, 80)))
    stops = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    text_after = [
        tokenizer.decode(ids[: i + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        for i in range(len(ids))
    ]
    stream = TextStream(tokenizer, stops)
    deltas = []
    for token in ids:
        deltas.append(stream.push(token))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    expected = reference_cut(text_after, stops)
    assert "".join(deltas) == expected == stream.text, (text, stops)
    assert stream.stopped == any(s in text_after[-1] for s in stops)


def test_a_stop_string_over_the_limit_is_refused():
    GenerateRequest(prompt="x", stop=["s" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS}"):
        GenerateRequest(prompt="x", stop=["s" * (MAX_STOP_CHARS + 1)])
