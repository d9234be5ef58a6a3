"""Incremental detokenization with stop sequences, shared by streamed and whole responses.

Both modes feed the same :class:`TextStream`, so the concatenated stream deltas equal
the text of a non-streamed response for the same request. Text is held back while it
ends in an incomplete UTF-8 sequence (the tokenizer shows U+FFFD) or in what may be the
start of a stop sequence; a stop sequence ends the generation and is not returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """push(token) -> text safe to send now; finish() -> the rest. ``stopped``: a stop sequence matched."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self._final: str | None = None

    def _decode(self) -> str:
        return self.tokenizer.decode(
            self.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that must wait: incomplete UTF-8 or a stop sequence's prefix."""
        end = len(text.rstrip(REPLACEMENT))
        hold = len(text) - end
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:k]):
                    longest = max(longest, k)
                    break
        return hold + longest

    def _advance(self, upto: str) -> str:
        if not upto.startswith(self.sent) or len(upto) <= len(self.sent):
            return ""
        delta = upto[len(self.sent) :]
        self.sent = upto
        return delta

    def push(self, token_id: int) -> str:
        """Add a generated token; returns the newly safe text ('' while held back or after a stop)."""
        if self.stopped:
            return ""
        self.token_ids.append(int(token_id))
        text = self._decode()
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._final = text[:cut]
            return self._advance(self._final)
        return self._advance(text[: len(text) - self._held_back(text)])

    @property
    def text(self) -> str:
        """The whole text so far (up to a stop sequence)."""
        return self._final if self._final is not None else self._decode()

    def finish(self) -> str:
        """The text not sent yet (held-back characters once the generation is over)."""
        final = self.text
        if final.startswith(self.sent):
            return self._advance(final)
        return ""
