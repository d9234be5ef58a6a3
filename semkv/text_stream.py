"""Incremental detokenization with stop sequences, shared by streamed and whole responses.

Both modes feed the same :class:`TextStream`, so the concatenated stream deltas equal
the text of a non-streamed response for the same request. Text is held back while it
ends in an incomplete UTF-8 sequence (the tokenizer shows U+FFFD) or in what may be the
start of a stop sequence; a stop sequence ends the generation and is not returned.

A token's cost does not grow with the length of the output:

* detokenizing decodes a short window of tokens (those since the last complete character: the
  difference of two decodes that start at the same token, so a decoder's start-of-text rules cancel),
  not the whole output;
* each stop sequence is matched by a streaming matcher (Knuth-Morris-Pratt) fed only the new
  characters: it knows at every character the longest end of the text that begins the stop
  sequence (what must be held back) and whether the sequence just completed, without looking at the
  text before the new window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class StopMatcher:
    """One stop sequence matched over a stream of characters, a few at a time (Knuth-Morris-Pratt).

    ``matched``: characters of the sequence the text read so far ends with (the longest such start, less
    than its whole length while it has not completed)."""

    def __init__(self, stop: str) -> None:
        if not stop:
            raise ValueError("a stop sequence must not be empty")
        self.stop = stop
        self.matched = 0
        self._fallback = _prefix_function(stop)

    def feed(self, text: str) -> int:
        """Read ``text`` (the characters after those read before); returns the index in ``text`` where the
        first completion of the stop sequence ends (exclusive), or -1 if it did not complete. After a
        completion the matcher stops reading."""
        stop, fallback, matched = self.stop, self._fallback, self.matched
        for i, char in enumerate(text):
            while matched and stop[matched] != char:
                matched = fallback[matched - 1]
            if stop[matched] == char:
                matched += 1
            if matched == len(stop):
                self.matched = matched
                return i + 1
        self.matched = matched
        return -1


def _prefix_function(pattern: str) -> list[int]:
    """``out[i]``: length of the longest proper prefix of ``pattern[: i + 1]`` that is also its suffix."""
    out = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = out[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        out[i] = k
    return out


class TextStream:
    """push(token) -> text safe to send now; finish() -> the rest. ``stopped``: a stop sequence matched."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.stopped = False
        self._matchers = [StopMatcher(s) for s in self.stop]
        self._complete = ""  # text of every token before ``_read`` (whole characters only)
        self._prefix = 0  # first token of the decode window
        self._read = 0  # tokens whose text is in ``_complete``
        self._sent = 0  # characters of ``_complete`` handed out
        self._final: str | None = None

    @property
    def sent(self) -> str:
        """The text handed out so far."""
        return self._complete[: self._sent] if self._final is None else self._final[: self._sent]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _pending(self) -> str:
        """The text of the tokens after ``_read`` (it may end in an incomplete character)."""
        window = self.token_ids[self._prefix :]
        before = self._decode(window[: self._read - self._prefix]) if self._read > self._prefix else ""
        return self._decode(window)[len(before) :]

    def push(self, token_id: int) -> str:
        """Add a generated token; returns the newly safe text ('' while held back or after a stop)."""
        if self.stopped:
            return ""
        self.token_ids.append(int(token_id))
        new = self._pending()
        if not new or new.endswith(REPLACEMENT):
            return ""  # an incomplete character: wait for the tokens that complete it
        start = len(self._complete)
        self._complete += new
        self._prefix, self._read = self._read, len(self.token_ids)
        cut = self._first_stop(new, start)
        if cut >= 0:
            self.stopped = True
            self._final = self._complete[:cut]
            return self._release(len(self._final))
        held = max((m.matched for m in self._matchers), default=0)
        return self._release(len(self._complete) - held)

    def _first_stop(self, new: str, start: int) -> int:
        """Where the earliest stop sequence completed in ``new`` (read from offset ``start`` of the text)
        begins, or -1."""
        cut = -1
        for matcher in self._matchers:
            end = matcher.feed(new)
            if end >= 0:
                begin = start + end - len(matcher.stop)
                cut = begin if cut < 0 else min(cut, begin)
        return cut

    def _release(self, upto: int) -> str:
        text = self._complete if self._final is None else self._final
        if upto <= self._sent:
            return ""
        delta = text[self._sent : upto]
        self._sent = upto
        return delta

    @property
    def text(self) -> str:
        """The whole text so far (up to a stop sequence)."""
        return self._final if self._final is not None else self._complete + self._pending()

    def finish(self) -> str:
        """The text not sent yet (held-back characters once the generation is over)."""
        if self._final is not None:
            return self._release(len(self._final))
        self._complete += self._pending()
        self._prefix = self._read = len(self.token_ids)
        return self._release(len(self._complete))
