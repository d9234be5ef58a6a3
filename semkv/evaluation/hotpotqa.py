"""HotpotQA as a RAG workload: each paragraph one chunk, official answer scoring.

A :class:`RagCase` holds one question's paragraphs as chunk texts, each rendered once by
:func:`paragraph_text` (``"Title: <title>\\n<sentences>"``), so a paragraph is the same text, hence
the same token ids and reusable chunk KV, in every case it appears in. Optionally the case is padded
with paragraphs of other questions (drawn, seeded, from a fixed pool, so padding chunks recur across
questions as in a real corpus) until the prompt reaches ``target_tokens`` as the tokenizer lays it
out (:func:`rag_layout`, the chat template when the tokenizer has one). The gold paragraphs (those
holding a supporting fact) sit at seeded positions among the others.

Rendering: a system message asks for a short answer (:data:`RAG_INSTRUCTION`), the chunks open the
user turn and the question closes it (``Question: ...``): ``build_layout(tokenizer,
messages=case.messages(), chunks=case.chunks)``; :meth:`RagCase.inline_messages` is the same
conversation with the documents written into the user turn, for clients without a chunk API.

Scoring is HotpotQA's own (``hotpot_evaluate_v1.py``): SQuAD normalisation, exact match as equality
of the normalised strings, token F1, and a prediction or gold answer of "yes" / "no" / "noanswer"
scores 0 unless both normalise to the same word. Small instruct models wrap their answer
("The answer is: Nils Gaup.", "\\nAnswer: 1989\\n\\nQuestion: ..."), so :func:`extract_answer` takes the
answer out of a generation first (leading answer cues, first line, first sentence); the official
normalisation is applied after it.

Questions come from the seeded dev/test splits of :mod:`semkv.evaluation.corpora`; each case's own
randomness is ``random.Random(f"{config.seed}:{item.id}")``, so a question gets the same case
whatever other questions are built with it.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from semkv.evaluation.corpora import HotpotItem, Paragraph, SquadItem, load_hotpotqa, squad_articles
from semkv.evaluation.metrics import normalize_answer
from semkv.prompt import CHUNK_SEPARATOR, PromptLayout, build_layout

RAG_INSTRUCTION = (
    "Answer the question based on the given documents. Give only the answer, in a few words, "
    "with no explanation."
)
SPECIAL_ANSWERS = ("yes", "no", "noanswer")

# A leading answer cue: "Answer:", "The answer is:", "The answer is", "The answer to this question is:",
# "Final answer:", "A:" (any case), with the whitespace (newlines included) after it.
_ANSWER_CUE = re.compile(
    r"\s*(?:(?:the\s+)?(?:final\s+|short\s+|correct\s+)?answer(?:\s+to\s+(?:this|the)\s+question)?"
    r"(?:\s*:|\s+is\s*:?)|a\s*:)\s*",
    re.IGNORECASE,
)
# A sentence end candidate: a word, then ., ! or ?, whitespace, and a capital or a quote ("Gaup. He");
# "No. 1", "Jan. 5" and "Pub.L." are not candidates. The word must end in two lower-case letters or
# digits and not be a title ("St. Louis", "U.S. Army", "Mrs. Smith" do not end a sentence).
_SENTENCE_END = re.compile(r"(\w+)[.!?]\s+(?=[A-Z\"'])")
_TITLES = frozenset({"mr", "mrs", "ms", "dr", "st", "jr", "sr", "prof", "gen", "col", "lt", "rev", "vs"})
# A parenthetical aside, closed or cut off by the token limit: "Bruce Conner (born 16 May 1961".
_PARENTHETICAL = re.compile(r"\s*\([^)]*(?:\)|$)")
_TRAILING = " \t.,;:!?"


def paragraph_text(paragraph: Paragraph) -> str:
    """The one rendering of a paragraph as a chunk: ``"Title: <title>\\n<sentences>"``."""
    return f"Title: {paragraph.title}\n{paragraph.text}"


def question_body(question: str) -> str:
    """The user-turn text after the documents."""
    return f"Question: {question}"


@dataclass(frozen=True)
class RagConfig:
    """How questions become cases.

    target_tokens: pad each case with other questions' paragraphs until its prompt (as
        :func:`rag_layout` lays it out) is as close to this many tokens as fits; None = the question's
        own paragraphs only. If the own paragraphs alone exceed it, non-gold ones are dropped (seeded);
        the gold paragraphs are always kept, so a case can exceed a very small target.
    seed: the cases' randomness (gold positions, order, padding) and the padding pool's draw.
    padding_pool: how many distinct HotpotQA paragraphs (drawn once, seeded, from the whole dataset)
        the padding comes from.
    """

    target_tokens: int | None = None
    seed: int = 0
    padding_pool: int = 512

    def __post_init__(self) -> None:
        if self.target_tokens is not None and (
            isinstance(self.target_tokens, bool)
            or not isinstance(self.target_tokens, int)
            or self.target_tokens < 1
        ):
            raise ValueError(f"target_tokens must be a positive int or None, got {self.target_tokens!r}")
        if (
            isinstance(self.padding_pool, bool)
            or not isinstance(self.padding_pool, int)
            or self.padding_pool < 1
        ):
            raise ValueError(f"padding_pool must be a positive int, got {self.padding_pool!r}")


@dataclass(frozen=True)
class RagCase:
    """One question laid out as chunks.

    chunks: paragraph texts in layout order; gold: indices into ``chunks`` of the supporting paragraphs;
    padding: how many chunks came from other questions; prompt_tokens: the prompt's length as
    :func:`rag_layout` lays it out (None when built without a tokenizer).
    """

    id: str
    question: str
    answer: str
    chunks: tuple[str, ...]
    gold: tuple[int, ...]
    padding: int
    prompt_tokens: int | None

    def messages(self) -> list[dict[str, str]]:
        """The conversation without documents: pass with ``chunks=self.chunks`` to build_layout / generate."""
        return rag_messages(self.question)

    def inline_messages(self) -> list[dict[str, str]]:
        """The same conversation with the documents written into the user turn (same text as the layout)."""
        system, user = rag_messages(self.question)
        content = CHUNK_SEPARATOR.join([*self.chunks, user["content"]])
        return [system, {"role": "user", "content": content}]


def rag_messages(question: str) -> list[dict[str, str]]:
    """System instruction + the question's user turn (the documents go in as chunks before it)."""
    return [
        {"role": "system", "content": RAG_INSTRUCTION},
        {"role": "user", "content": question_body(question)},
    ]


def rag_layout(tokenizer, case: RagCase, use_chat_template: bool | None = None) -> PromptLayout:
    """The case as semkv lays it out: template | chunk | sep | ... | question | suffix."""
    return build_layout(
        tokenizer, messages=case.messages(), chunks=case.chunks, use_chat_template=use_chat_template
    )


@lru_cache(maxsize=4)
def padding_paragraphs(size: int, seed: int) -> tuple[Paragraph, ...]:
    """``size`` distinct paragraphs drawn with ``random.Random(seed)`` from all HotpotQA paragraphs."""
    distinct = list({paragraph_text(p): p for item in load_hotpotqa() for p in item.paragraphs}.values())
    if size > len(distinct):
        raise ValueError(f"padding_pool must be at most {len(distinct)}, got {size}")
    return tuple(random.Random(seed).sample(distinct, size))


class _TokenCounter:
    """Token counts of texts, each tokenized once (as build_layout tokenizes a chunk)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.counts: dict[str, int] = {}
        self.separator = len(tokenizer(CHUNK_SEPARATOR, add_special_tokens=False)["input_ids"])

    def chunk_cost(self, text: str) -> int:
        """Tokens a chunk adds to a layout: its own and its separator's."""
        if text not in self.counts:
            self.counts[text] = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.counts[text] + self.separator

    def overhead(self, question: str) -> int:
        """Tokens of the layout without chunks (template, question, generation prompt)."""
        return len(build_layout(self.tokenizer, messages=rag_messages(question)))


def _own_paragraphs(item: HotpotItem) -> tuple[list[Paragraph], list[Paragraph]]:
    """(gold, other) paragraphs of the item, each text once."""
    distinct = list({paragraph_text(p): p for p in item.paragraphs}.values())
    gold = [p for p in distinct if p.title in item.gold_titles]
    return gold, [p for p in distinct if p.title not in item.gold_titles]


class RagBuilder:
    """Builds cases under one config; counts each paragraph's tokens once across cases.

    tokenizer: needed when ``config.target_tokens`` is set; when given, cases carry prompt_tokens.
    """

    def __init__(self, config: RagConfig = RagConfig(), tokenizer=None) -> None:
        if config.target_tokens is not None and tokenizer is None:
            raise ValueError("target_tokens needs a tokenizer to count tokens with")
        self.config = config
        self.counter = _TokenCounter(tokenizer) if tokenizer is not None else None

    def build(self, item: HotpotItem) -> RagCase:
        """The item's case: its paragraphs (+ padding), gold ones at seeded positions."""
        config, counter = self.config, self.counter
        rng = random.Random(f"{config.seed}:{item.id}")
        gold, others = _own_paragraphs(item)
        rng.shuffle(others)
        padding: list[Paragraph] = []
        if config.target_tokens is not None:
            budget = config.target_tokens - counter.overhead(item.question)
            used = sum(counter.chunk_cost(paragraph_text(p)) for p in gold + others)
            while others and used > budget:
                used -= counter.chunk_cost(paragraph_text(others.pop()))
            titles = {p.title for p in item.paragraphs}
            pool = padding_paragraphs(config.padding_pool, config.seed)
            for p in rng.sample(pool, len(pool)):
                cost = counter.chunk_cost(paragraph_text(p))
                if p.title not in titles and used + cost <= budget:
                    padding.append(p)
                    titles.add(p.title)
                    used += cost
        order = others + padding
        rng.shuffle(order)
        for p in gold:
            order.insert(rng.randint(0, len(order)), p)
        chunks = tuple(paragraph_text(p) for p in order)
        gold_texts = {paragraph_text(p) for p in gold}
        tokens = None
        if counter is not None:
            tokens = counter.overhead(item.question) + sum(counter.chunk_cost(c) for c in chunks)
        return RagCase(
            id=item.id,
            question=item.question,
            answer=item.answer,
            chunks=chunks,
            gold=tuple(i for i, c in enumerate(chunks) if c in gold_texts),
            padding=len(padding),
            prompt_tokens=tokens,
        )


def build_rag_cases(
    items: Sequence[HotpotItem], config: RagConfig = RagConfig(), tokenizer=None
) -> list[RagCase]:
    """A case per item (see :class:`RagBuilder`)."""
    builder = RagBuilder(config, tokenizer)
    return [builder.build(item) for item in items]


@dataclass(frozen=True)
class HotpotScore:
    """HotpotQA's answer metrics for one prediction: em in {0, 1}; f1, precision, recall in [0, 1]."""

    em: float
    f1: float
    precision: float
    recall: float


def first_line(text: str) -> str:
    """The first non-empty line of a generation, stripped ("" if there is none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def extract_answer(text: str) -> str:
    """The answer inside a generation: leading answer cues removed (repeatedly: "Answer:\\nAnswer: X"),
    then the first non-empty line without parenthetical asides, its first sentence, without trailing
    punctuation.

    ``"The answer is:\\n\\n2012."`` -> ``"2012"``; ``"\\nAnswer: Las Vegas, Nevada\\n\\nQuestion: ..."`` ->
    ``"Las Vegas, Nevada"``; ``"Answer: Bruce Conner (born 1933). He ..."`` -> ``"Bruce Conner"``. A cue
    that does not open the generation is kept (the text is not searched for one).
    """
    rest = text
    while (cue := _ANSWER_CUE.match(rest)) is not None and cue.end() > 0:
        rest = rest[cue.end() :]
    line = _PARENTHETICAL.sub("", first_line(rest))
    return first_sentence(line).rstrip(_TRAILING)


def first_sentence(line: str) -> str:
    """``line`` up to its first sentence end (see ``_SENTENCE_END``), the end's punctuation kept."""
    for end in _SENTENCE_END.finditer(line):
        word = end.group(1)
        if re.fullmatch(r".*[a-z0-9]{2}", word) and word.lower() not in _TITLES:
            return line[: end.end(1) + 1]
    return line


def hotpot_score(prediction: str, answer: str) -> HotpotScore:
    """Exact match and token F1 as ``hotpot_evaluate_v1.py`` computes them (see the module docstring)."""
    pred, gold = normalize_answer(prediction), normalize_answer(answer)
    em = float(pred == gold)
    if (pred in SPECIAL_ANSWERS or gold in SPECIAL_ANSWERS) and pred != gold:
        return HotpotScore(em, 0.0, 0.0, 0.0)
    common = Counter(pred.split()) & Counter(gold.split())
    same = sum(common.values())
    if same == 0:
        return HotpotScore(em, 0.0, 0.0, 0.0)
    precision, recall = same / len(pred.split()), same / len(gold.split())
    return HotpotScore(em, 2 * precision * recall / (precision + recall), precision, recall)


def squad_case(item: SquadItem, paragraphs: int = 6, seed: int = 0) -> RagCase:
    """A SQuAD question as a RAG case: its own paragraph and up to ``paragraphs - 1`` other paragraphs of
    the same article, as chunks in a seeded order (``gold`` = the question's paragraph). The answer is
    the annotators' first; score against every one of ``item.answers``."""
    if isinstance(paragraphs, bool) or not isinstance(paragraphs, int) or paragraphs < 1:
        raise ValueError(f"paragraphs must be an int >= 1, got {paragraphs!r}")
    rng = random.Random(f"{seed}:{item.id}")
    others = [p for p in squad_articles()[item.article] if p != item.context]
    chosen = rng.sample(others, min(len(others), paragraphs - 1))
    at = rng.randint(0, len(chosen))
    chunks = tuple(chosen[:at] + [item.context] + chosen[at:])
    return RagCase(item.id, item.question, item.answers[0], chunks, (at,), 0, None)
