"""RULER's task families (Hsieh et al., 2024) as small frozen dataclasses, one per family, each drawing a
case's randomness and leaving its haystack size open (:class:`Sizer`); :mod:`semkv.evaluation.ruler`
fits the size to a length, renders and scores. :data:`TASKS` holds the 13 tasks of RULER's
``synthetic.yaml`` with its parameters. Prompts, needles and answer prefixes are RULER's wording.
Haystacks: the package's Paul Graham essays (RULER's ``PaulGrahamEssays.json``), RULER's repeated noise
sentences, or lines of distractor needles; words for keys and cwe come from the essays' vocabulary and
sentences are split by a regex (:func:`split_sentences`), so nothing is downloaded.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import string
import uuid
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Literal

from semkv.evaluation.corpora import (
    Split,
    essay_words,
    hotpot_split,
    load_hotpotqa,
    squad_articles,
    squad_split,
)

Metric = Literal["string_match_all", "string_match_part"]
NeedleType = Literal["words", "numbers", "uuids"]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {types} for {key} is: {value}."
DEPTH_GRID = tuple(round(100 * i / 39) for i in range(40))  # RULER's 40 depths, percent
DOCUMENT = "Document {i}:\n{text}"


# -- text helpers -----------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?][\"')\]]* (?=[\"'(\[]?[A-Z0-9])")
_ABBREVIATIONS = frozenset("mr mrs ms dr st jr sr vs etc e.g i.e inc co ltd no prof gen fig u.s".split())


def _sentence_starts(text: str) -> list[int]:
    """Offsets where a sentence starts (0 first); ``text`` has single spaces between words."""
    starts = [0]
    for m in _SENTENCE_END.finditer(text):
        word = text[text.rfind(" ", 0, m.start()) + 1 : m.start()].lower().strip("\"'([")
        if word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha()):
            continue  # "Mr. Smith", "J. Smith"
        starts.append(m.end())
    return starts


def split_sentences(text: str) -> list[str]:
    """Sentences of whitespace-normalised ``text``: a break after . ! ? (and closing quotes or
    brackets) before a capital or digit, except after common abbreviations and initials."""
    text = " ".join(text.split())
    starts = _sentence_starts(text) + [len(text) + 1]
    return [text[a : b - 1] if b <= len(text) else text[a:] for a, b in zip(starts, starts[1:], strict=False)]


def _insert_sentences(text: str, items: Sequence[tuple[float, str]]) -> str:
    """Insert each (depth, sentence) at the sentence boundary nearest ``depth`` of the characters."""
    starts = _sentence_starts(text) + [len(text) + 1]  # the last: after the end
    cuts = []
    for depth, sentence in items:
        target = depth * len(text)
        i = bisect.bisect_left(starts, target)
        nearest = min((j for j in (i - 1, i) if 0 <= j < len(starts)), key=lambda j: abs(starts[j] - target))
        cuts.append((starts[nearest], sentence))
    for at, sentence in sorted(cuts, key=lambda c: c[0], reverse=True):  # from the end: offsets stay valid
        text = text + " " + sentence if at > len(text) else text[:at] + sentence + " " + text[at:]
    return text


@lru_cache(maxsize=1)
def essay_text() -> str:
    """The package's essays as one whitespace-normalised text (RULER's essay haystack)."""
    return " ".join(essay_words())


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Word list for keys and cwe: lower-case essay words of 4-10 letters seen >= 3 times, without the
    200 most frequent (mostly function words); sorted."""
    counts = Counter(w for w in essay_words() if re.fullmatch(r"[a-z]{4,10}", w))
    frequent = {w for w, _ in counts.most_common(200)}
    return tuple(sorted(w for w, c in counts.items() if c >= 3 and w not in frequent))


def _random_value(kind: NeedleType, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits, as RULER
    if kind == "words":
        first, second = rng.sample(vocabulary(), 2)
        return f"{first}-{second}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be words, numbers or uuids, got {kind!r}")


def draw_unique(
    kind: NeedleType, count: int, rng: random.Random, taken: set[str], haystack: str = ""
) -> list[str]:
    """``count`` values not in ``taken`` (updated) and not occurring in ``haystack``."""
    out = []
    while len(out) < count:
        value = _random_value(kind, rng)
        if value not in taken and value not in haystack:
            taken.add(value)
            out.append(value)
    return out


# -- the tasks --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Draft:
    """A case's text at one haystack size."""

    prompt: str
    context: str
    query: str
    answer_prefix: str
    outputs: tuple[str, ...]
    example: tuple[str, str] | None = None
    inserted: tuple[str, ...] = ()
    depths: tuple[float, ...] = ()


@dataclass(frozen=True)
class Sizer:
    """A case's randomness drawn, its haystack size open: ``draft(n)`` for n in [low, high]."""

    draft: Callable[[int], Draft]
    low: int
    high: int


class RulerTask(ABC):
    """A RULER task family; one frozen dataclass per family holds the task's parameters."""

    family: ClassVar[str]
    tokens_to_generate: ClassVar[int]
    metric: ClassVar[Metric]

    @abstractmethod
    def sizer(self, rng: random.Random, length: int, split: Split, index: int, seed: int) -> Sizer:
        """Draw everything random about one case; leave the haystack size to the fitting."""


@dataclass(frozen=True)
class NiahTask(RulerTask):
    """Needles "One of the special magic {values} for {key} is: {value}." in a haystack: ``repeat``
    (the noise paragraph, one per line), ``essay`` or ``needle`` (lines of distractor needles)."""

    haystack: Literal["repeat", "essay", "needle"]
    key_type: NeedleType
    value_type: NeedleType
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    family: ClassVar[str] = "niah"
    tokens_to_generate: ClassVar[int] = 128
    metric: ClassVar[Metric] = "string_match_all"

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "num_queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def sizer(self, rng: random.Random, length: int, split: Split, index: int, seed: int) -> Sizer:
        num_keys = max(self.num_keys, self.num_queries)
        forbid = essay_text() if self.haystack == "essay" else NOISE
        taken: set[str] = set()
        keys = draw_unique(self.key_type, num_keys, rng, taken, forbid)
        values = [draw_unique(self.value_type, self.num_values, rng, taken, forbid) for _ in keys]
        needles = [(k, v) for k, vs in zip(keys, values, strict=True) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(num_keys), self.num_queries)
        outputs = tuple(v for i in asked for v in values[i])
        query = (
            keys[asked[0]]
            if len(asked) == 1
            else ", ".join(keys[i] for i in asked[:-1]) + f", and {keys[asked[-1]]}"
        )
        if self.haystack == "essay":
            depths = [d / 100 for d in sorted(rng.sample(DEPTH_GRID, len(needles)))]
        else:
            depths = [rng.random() for _ in needles]
        plural = self.value_type
        texts = [NEEDLE.format(types=plural, key=k, value=v) for k, v in needles]
        by_value = {v: (t, d) for (_, v), t, d in zip(needles, texts, depths, strict=True)}
        distractors: list[str] = []
        high = min(len(essay_words()), 2 * length) if self.haystack == "essay" else length // 8
        if self.haystack == "needle":
            d_keys = draw_unique(self.key_type, high, rng, taken)
            d_values = draw_unique(self.value_type, high, rng, taken)
            distractors = [
                NEEDLE.format(types=plural, key=k, value=v) for k, v in zip(d_keys, d_values, strict=True)
            ]
        single = self.num_queries * self.num_values == 1
        kind = plural[:-1] if single else plural
        if single:
            prompt_tpl = (
                f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the {kind} afterwards.\n{{context}}\n"
                f"What is the special magic {kind} for {query} mentioned in the provided text?"
            )
            prefix = f" The special magic {kind} for {query} mentioned in the provided text is"
        else:
            prompt_tpl = (
                f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the {kind} afterwards.\n{{context}}\n"
                f"What are all the special magic {kind} for {query} mentioned in the provided text?"
            )
            prefix = f" The special magic {kind} for {query} mentioned in the provided text are"

        def draft(n: int) -> Draft:
            if self.haystack == "essay":
                context = _insert_sentences(
                    " ".join(essay_words()[:n]), list(zip(depths, texts, strict=True))
                )
            else:
                lines = [NOISE] * n if self.haystack == "repeat" else distractors[:n]
                for at, text in sorted(
                    ((int(d * n), t) for d, t in zip(depths, texts, strict=True)), reverse=True
                ):
                    lines.insert(at, text)
                context = "\n".join(lines)
            return Draft(
                prompt=prompt_tpl.format(context=context),
                context=context,
                query=query,
                answer_prefix=prefix,
                outputs=outputs,
                inserted=tuple(by_value[v][0] for v in outputs),
                depths=tuple(by_value[v][1] for v in outputs),
            )

        return Sizer(draft, 1, high)


VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)  # RULER's wording, typo included
VT_EXAMPLE_NOISE = 18


@dataclass(frozen=True)
class VariableTrackingTask(RulerTask):
    """Chains "VAR B = VAR A" from "VAR A = <5 digits>" hidden in noise lines; name every variable of
    the first chain."""

    num_chains: int = 1
    num_hops: int = 4
    family: ClassVar[str] = "variable_tracking"
    tokens_to_generate: ClassVar[int] = 30
    metric: ClassVar[Metric] = "string_match_all"

    def __post_init__(self) -> None:
        if self.num_chains < 1 or self.num_hops < 1:
            raise ValueError(f"num_chains and num_hops must be >= 1, got {self.num_chains}, {self.num_hops}")

    def _chains(self, rng: random.Random, letters: int) -> list[tuple[list[str], list[str], list[float]]]:
        """Per chain: its variables, its statements and their (sorted) depths."""
        taken: set[str] = set()
        out = []
        for _ in range(self.num_chains):
            names = []
            while len(names) < self.num_hops + 1:
                name = "".join(rng.choices(string.ascii_uppercase, k=letters))
                if name not in taken:
                    taken.add(name)
                    names.append(name)
            value = str(rng.randint(10000, 99999))
            while value in taken:
                value = str(rng.randint(10000, 99999))
            taken.add(value)
            statements = [f"VAR {names[0]} = {value}"] + [
                f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:], strict=False)
            ]
            out.append((names, statements, sorted(rng.random() for _ in statements)))
        return out

    def _text(self, chains, n: int) -> tuple[str, str, str, list[float]]:
        """(prompt, context, value asked, depths of the first chain's statements) with n noise lines."""
        items: list[str] = [NOISE + "\n"] * n
        for _, statements, fractions in chains:
            for j, (statement, fraction) in enumerate(zip(statements, fractions, strict=True)):
                items.insert(int(fraction * n) + j, statement)
        context = " ".join(items)
        starts, at = {}, 0
        for item in items:
            starts.setdefault(item, at)  # statements are unique; noise lines are not looked up
            at += len(item) + 1
        value = chains[0][1][0].rsplit(" ", 1)[1]
        depths = [starts[s] / len(context) for s in chains[0][1]]
        return VT_TEMPLATE.format(context=context, query=value), context, value, depths

    def sizer(self, rng: random.Random, length: int, split: Split, index: int, seed: int) -> Sizer:
        example_chains = self._chains(rng, letters=3)
        example_prompt, _, example_value, _ = self._text(example_chains, VT_EXAMPLE_NOISE)
        num_v = self.num_hops + 1
        example_reply = (
            VT_PREFIX.format(num_v=num_v, query=example_value).strip() + " " + " ".join(example_chains[0][0])
        )
        chains = self._chains(rng, letters=5)

        def draft(n: int) -> Draft:
            prompt, context, value, depths = self._text(chains, n)
            return Draft(
                prompt=prompt,
                context=context,
                query=value,
                answer_prefix=VT_PREFIX.format(num_v=num_v, query=value),
                outputs=tuple(chains[0][0]),
                example=(example_prompt, example_reply),
                inserted=tuple(chains[0][1]),
                depths=tuple(depths),
            )

        return Sizer(draft, 1, max(2, length // 8))


CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the {num_cw} most common words in the above list?"
)
CWE_PREFIX = " Answer: The top {num_cw} words that appear most often in the list are:"


@dataclass(frozen=True)
class CommonWordsTask(RulerTask):
    """A numbered word list where ``num_cw`` words appear ``freq_cw`` times and the others ``freq_ucw``
    times; name the common ones. Below 4,096 tokens RULER uses 6 and 1 repeats (and a smaller example)."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    family: ClassVar[str] = "common_words_extraction"
    tokens_to_generate: ClassVar[int] = 120
    metric: ClassVar[Metric] = "string_match_all"

    def __post_init__(self) -> None:
        if not self.freq_cw > self.freq_ucw >= 1 or self.num_cw < 1:
            raise ValueError(f"need freq_cw > freq_ucw >= 1 and num_cw >= 1, got {self}")

    def _list(self, words: Sequence[str], common: int, uncommon: int, rng: random.Random) -> str:
        listed = [w for w in words[: self.num_cw] for _ in range(common)]
        listed += [w for w in words[self.num_cw :] for _ in range(uncommon)]
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))

    def sizer(self, rng: random.Random, length: int, split: Split, index: int, seed: int) -> Sizer:
        if length < 4096:
            (ex_words, ex_common, ex_uncommon), (common, uncommon) = (20, 3, 1), (6, 1)
        else:
            (ex_words, ex_common, ex_uncommon), (common, uncommon) = (
                (40, 10, 3),
                (self.freq_cw, self.freq_ucw),
            )
        words = rng.sample(vocabulary(), len(vocabulary()))
        example_words, words = words[-ex_words:], words[:-ex_words]
        example_context = self._list(example_words, ex_common, ex_uncommon, random.Random(rng.random()))
        example = (
            CWE_TEMPLATE.format(context=example_context, num_cw=self.num_cw),
            CWE_PREFIX.format(num_cw=self.num_cw).strip()
            + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(example_words[: self.num_cw])),
        )
        shuffle_seed = rng.random()

        def draft(n: int) -> Draft:
            context = self._list(words[:n], common, uncommon, random.Random(shuffle_seed))
            return Draft(
                prompt=CWE_TEMPLATE.format(context=context, num_cw=self.num_cw),
                context=context,
                query="",
                answer_prefix=CWE_PREFIX.format(num_cw=self.num_cw),
                outputs=tuple(words[: self.num_cw]),
                example=example,
            )

        return Sizer(draft, self.num_cw, min(len(words), max(self.num_cw + 1, length // 2)))


FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_WORD_LETTERS = 6


@lru_cache(maxsize=8)
def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum + Euler-Maclaurin tail; error < 1e-9 for alpha >= 1.5)."""
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1, got {alpha}")
    head = sum(k**-alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


@dataclass(frozen=True)
class FrequentWordsTask(RulerTask):
    """Coded 6-letter words with Zipf(``alpha``) counts over a vocabulary of length // 50 words; the most
    frequent is "..." (noise); name the next three."""

    alpha: float = 2.0
    family: ClassVar[str] = "freq_words_extraction"
    tokens_to_generate: ClassVar[int] = 50
    metric: ClassVar[Metric] = "string_match_all"

    def __post_init__(self) -> None:
        if not self.alpha > 1:
            raise ValueError(f"alpha must be > 1, got {self.alpha}")

    def counts(self, total: int, size: int) -> list[int]:
        """Occurrences of the words ranked 1..size for a text of about ``total`` words."""
        z = zeta(self.alpha)
        return [int(total * k**-self.alpha / z) for k in range(1, size + 1)]

    def sizer(self, rng: random.Random, length: int, split: Split, index: int, seed: int) -> Sizer:
        size = max(5, length // 50)
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LETTERS)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."
        shuffle_seed = rng.random()
        # from this many words on, ranks 2..5 have strictly decreasing counts (the answer is unambiguous)
        low = math.ceil(zeta(self.alpha) / min(k**-self.alpha - (k + 1) ** -self.alpha for k in (2, 3, 4)))

        def draft(n: int) -> Draft:
            words = [w for w, c in zip(ranked, self.counts(n, size), strict=True) for _ in range(c)]
            random.Random(shuffle_seed).shuffle(words)
            context = " ".join(words)
            return Draft(
                prompt=FWE_TEMPLATE.format(context=context),
                context=context,
                query="",
                answer_prefix=FWE_PREFIX,
                outputs=tuple(ranked[1:4]),
            )

        return Sizer(draft, low, max(low + 1, 2 * length))


QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"


@lru_cache(maxsize=1)
def _squad_documents() -> tuple[tuple[str, ...], dict[str, int], dict[str, tuple[int, ...]]]:
    """All distinct SQuAD paragraphs, text -> index, and each article's paragraph indices."""
    docs: dict[str, int] = {}
    by_article: dict[str, list[int]] = defaultdict(list)
    for title, paragraphs in squad_articles().items():
        for p in paragraphs:
            by_article[title].append(docs.setdefault(p, len(docs)))
    return tuple(docs), docs, {t: tuple(v) for t, v in by_article.items()}


@lru_cache(maxsize=1)
def _hotpot_documents() -> tuple[tuple[str, ...], dict[str, int]]:
    """All distinct HotpotQA paragraphs rendered as RULER does ("title\\ntext"), and text -> index."""
    docs: dict[str, int] = {}
    for item in load_hotpotqa():
        for p in item.paragraphs:
            docs.setdefault(f"{p.title}\n{''.join(p.sentences)}", len(docs))
    return tuple(docs), docs


@lru_cache(maxsize=8)
def _question_order(dataset: str, split: Split, seed: int) -> tuple:
    items = squad_split(split) if dataset == "squad" else hotpot_split(split)
    return tuple(random.Random(f"qa:{dataset}:{split}:{seed}").sample(items, len(items)))


@dataclass(frozen=True)
class QaTask(RulerTask):
    """A question over many documents: its own (gold first), then others; RULER's QA prompt."""

    dataset: Literal["squad", "hotpotqa"]
    family: ClassVar[str] = "qa"
    tokens_to_generate: ClassVar[int] = 32
    metric: ClassVar[Metric] = "string_match_part"

    def __post_init__(self) -> None:
        if self.dataset not in ("squad", "hotpotqa"):
            raise ValueError(f"dataset must be squad or hotpotqa, got {self.dataset!r}")

    def sizer(self, rng: random.Random, length: int, split: Split, index: int, seed: int) -> Sizer:
        order = _question_order(self.dataset, split, seed)
        item = order[index % len(order)]
        if self.dataset == "squad":
            docs, index_of, by_article = _squad_documents()
            gold = [index_of[item.context]]
            own = [i for i in by_article[item.article] if i != gold[0]]
            question, outputs = item.question, tuple(item.answers)
        else:
            docs, index_of = _hotpot_documents()
            texts = [f"{p.title}\n{''.join(p.sentences)}" for p in item.paragraphs]
            gold = list(
                dict.fromkeys(
                    index_of[t]
                    for p, t in zip(item.paragraphs, texts, strict=True)
                    if p.title in item.gold_titles
                )
            )
            own = list(dict.fromkeys(index_of[t] for t in texts if index_of[t] not in gold))
            question, outputs = item.question, (item.answer,)
        own = rng.sample(own, len(own))
        high = len(gold) + len(own) + max(16, length // 16)
        mine = set(gold) | set(own)
        others = [i for i in rng.sample(range(len(docs)), min(len(docs), high + len(mine))) if i not in mine]
        candidates = own + others
        order_seed = rng.random()

        def draft(n: int) -> Draft:
            chosen = gold + candidates[: n - len(gold)]
            random.Random(order_seed).shuffle(chosen)
            parts = [DOCUMENT.format(i=i + 1, text=docs[d]) for i, d in enumerate(chosen)]
            context = "\n\n".join(parts)
            offsets = [0]
            for part in parts:
                offsets.append(offsets[-1] + len(part) + 2)
            where = {d: offsets[i] / len(context) for i, d in enumerate(chosen)}
            return Draft(
                prompt=QA_TEMPLATE.format(context=context, query=question),
                context=context,
                query=question,
                answer_prefix=QA_PREFIX,
                outputs=outputs,
                inserted=tuple(docs[d] for d in gold),
                depths=tuple(where[d] for d in gold),
            )

        return Sizer(draft, len(gold), len(gold) + len(candidates))


TASKS: dict[str, RulerTask] = {
    "niah_single_1": NiahTask("repeat", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahTask("needle", "words", "numbers"),
    "niah_multikey_3": NiahTask("needle", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", num_queries=4),
    "vt": VariableTrackingTask(num_chains=1, num_hops=4),
    "cwe": CommonWordsTask(freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": FrequentWordsTask(alpha=2.0),
    "qa_1": QaTask("squad"),
    "qa_2": QaTask("hotpotqa"),
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)
