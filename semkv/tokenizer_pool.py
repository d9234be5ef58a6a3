"""Tokenizing off the engine thread: copies of the engine's tokenizer, and how long a text may be.

A Hugging Face fast tokenizer is not safe to use from two threads at once (an encode may change its
truncation / padding state while another reads it: "Already borrowed"), and the engine's own tokenizer is
used under the engine's lock by the engine thread (detokenizing streams, precomputing chunks).
:class:`TokenizerPool` lends private copies, each to one thread at a time, so requests are tokenized on
the server's worker threads without the engine's lock and without waiting for a step.

:func:`max_chars_per_token` bounds how many characters of user text one token can cover, so that a text
longer than ``context x that bound`` characters is known to exceed the model's context before it is
tokenized (:meth:`semkv.engine.Engine.max_prompt_chars`).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

# Unicode normalizers that may fold several code points of the input into one (canonical or compatible
# composition: a base letter and its combining marks, a Hangul syllable's two or three jamo). Composition
# folds at most a base and a few marks into one character in practice; this factor keeps the bound
# permissive for such input.
COMPOSING_NORMALIZERS = ("NFC", "NFKC")
COMPOSITION_FACTOR = 4


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters of user text one token of ``tokenizer`` covers.

    The longest string in the tokenizer's vocabulary, in characters: a byte-level BPE token's string has
    one character per byte (its text has at most as many characters), a SentencePiece token's string has
    one per character (``▁`` for a space; a byte-fallback token ``<0x0A>`` is longer than its one
    character). Special tokens count too (user text never produces them: the bound only grows). Where the
    tokenizer normalizes with Unicode composition (NFC / NFKC), several input characters may become one
    normalized character, so the bound is multiplied by :data:`COMPOSITION_FACTOR`. A text of ``n``
    characters therefore tokenizes (segment by segment, without special tokens) into at least
    ``n / bound`` tokens."""
    vocab = tokenizer.get_vocab()
    longest = max((len(token) for token in vocab), default=1)
    return max(1, longest) * (COMPOSITION_FACTOR if _composes(tokenizer) else 1)


def _composes(tokenizer: Any) -> bool:
    """Whether the tokenizer's normalizer composes Unicode (NFC / NFKC); True where it cannot be read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return True  # a slow tokenizer: its normalization is unknown, assume the worst
    try:
        normalizer = json.loads(backend.to_str()).get("normalizer")
    except (AttributeError, TypeError, ValueError) as exc:
        log.debug("could not read the tokenizer's normalizer (%s): assuming it composes", exc)
        return True
    text = json.dumps(normalizer)
    return any(f'"{name}"' in text for name in COMPOSING_NORMALIZERS)


class TokenizerPool:
    """Up to ``size`` private copies of one tokenizer, each lent to one thread at a time.

    Copies are made on first need (a deep copy of the tokenizer; the original is never lent); a thread
    that finds every copy lent waits for one. Thread-safe."""

    def __init__(self, tokenizer: Any, size: int = 2) -> None:
        if size < 1:
            raise ValueError(f"a tokenizer pool needs at least one copy, got {size}")
        self._original = tokenizer
        self._size = size
        self._free: list[Any] = []
        self._made = 0
        self._ready = threading.Condition(threading.Lock())

    @property
    def copies(self) -> int:
        """Copies made so far."""
        with self._ready:
            return self._made

    @contextmanager
    def borrow(self) -> Iterator[Any]:
        """A copy of the tokenizer for this thread alone until the ``with`` block ends."""
        tokenizer = self._take()
        try:
            yield tokenizer
        finally:
            with self._ready:
                self._free.append(tokenizer)
                self._ready.notify()

    def _take(self) -> Any:
        with self._ready:
            while not self._free and self._made >= self._size:
                self._ready.wait()
            if self._free:
                return self._free.pop()
            self._made += 1  # reserve the slot; copy outside the lock
        try:
            return copy.deepcopy(self._original)
        except BaseException:
            with self._ready:
                self._made -= 1
                self._ready.notify()
            raise
