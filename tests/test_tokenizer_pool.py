"""Tokenizing beside the engine: the character bound per token, and tokenizer copies lent one thread at a time.

Injected: texts built to make few tokens cover many characters (long runs of one character, of spaces
after a newline, repeated words, CJK, emoji, random Unicode), and many threads tokenizing at once through
a pool of two copies. Must hold: every text has at least ``len(text) / max_chars_per_token`` tokens (so
the engine's character limit never refuses a prompt that fits); concurrent tokenization gives the ids a
single thread gets; no copy is lent to two threads at once, the original tokenizer never, and no more
copies are made than the pool's size.
"""

from __future__ import annotations

import random
import threading

import pytest

from semkv.prompt import tokenize_text
from semkv.tokenizer_pool import TokenizerPool, max_chars_per_token


def adversarial_texts() -> list[str]:
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(32, 0x2FFF) if chr(c).isprintable()] + ["🎉", "😀", "\n", "\t"]
    texts = [
        "#" * 5000,
        "=" * 5000,
        "\n" + " " * 4000,
        "    " * 1000,
        "\n\n\n" * 1000,
        "the " * 2000,
        "日本語の文章です。" * 300,
        "🎉" * 1000,
        "a" * 3000,
        "".join(rng.choice(alphabet) for _ in range(4000)),
    ]
    return texts


def test_the_character_bound_holds(tokenizer):
    bound = max_chars_per_token(tokenizer)
    for text in adversarial_texts():
        ids = tokenize_text(tokenizer, text)
        assert len(text) <= bound * len(ids), (text[:40], len(text), len(ids), bound)


def test_the_bound_holds_for_the_vocabularys_longest_token_repeated(tokenizer):
    """The worst case: the text the longest vocabulary entry decodes to, many times over."""
    bound = max_chars_per_token(tokenizer)
    vocab = tokenizer.get_vocab()
    longest = max(vocab, key=len)
    text = tokenizer.decode([vocab[longest]]) * 200
    ids = tokenize_text(tokenizer, text)
    assert len(text) <= bound * len(ids), (longest, len(text), len(ids), bound)


def test_copies_are_private_and_give_the_same_ids(tokenizer):
    pool = TokenizerPool(tokenizer, size=2)
    texts = [f"Request {i}: " + "the lighthouse keeper writes a letter. " * (50 + i) for i in range(12)]
    expected = [tokenize_text(tokenizer, t) for t in texts]
    results: dict[int, list[int]] = {}
    holders: dict[int, int] = {}  # id of a lent copy -> threads holding it now
    overlap: list[int] = []
    lent_original: list[bool] = []
    guard = threading.Lock()

    def work(i: int) -> None:
        with pool.borrow() as copy:
            with guard:
                holders[id(copy)] = holders.get(id(copy), 0) + 1
                if holders[id(copy)] > 1:
                    overlap.append(i)
                lent_original.append(copy is tokenizer)
            results[i] = tokenize_text(copy, texts[i])
            with guard:
                holders[id(copy)] -= 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(len(texts))] == expected
    assert not overlap and not any(lent_original)
    assert pool.copies <= 2


def test_a_pool_needs_a_copy():
    with pytest.raises(ValueError):
        TokenizerPool(object(), size=0)
