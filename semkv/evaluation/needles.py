"""Needle-in-a-haystack tasks over Paul Graham essays: passkey and multi-fact retrieval.

Each case is seeded: the essay the haystack starts from, the needle's depth and its
answer come from ``random.Random(seed)``. The prompt keeps the usual passkey preamble
(DESIGN.md: SmolLM2 solves far more cases with it) and ends with the answer's lead-in
so the answer is the first few generated tokens.

Calibrated so that dense SmolLM2-135M solves the task at 8K tokens: with the chat
template (question in the user turn) the instruct model answers with a definition of
"pass key", and a needle inside a paragraph is found less often than one standing alone.
So the needle is its own paragraph and the prompt is plain text, without the chat
template (:func:`prompt_ids`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from semkv.evaluation.essays import essays, haystack
from semkv.prompt import build_layout

TASKS = ("passkey", "multifact")
# the case mix: two passkey cases per multi-fact case (the accuracy target is on passkey; dense
# SmolLM2 solves 4/6 multi-fact cases at 2K but 0/3 at 8K, where it picks another door's code)
TASK_CYCLE = ("passkey", "multifact", "passkey")

PASSKEY_PREAMBLE = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key there.\n\n"
)
FACT_PREAMBLE = (
    "Some secret codes are hidden inside a lot of irrelevant text. Find them and memorize them. "
    "I will quiz you about one of them.\n\n"
)
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "golden")


@dataclass
class NeedleCase:
    """One retrieval case: a prompt, the expected answer and where the needle sits.

    depth: position of the (asked) needle as a fraction of the haystack.
    needle_text: the sentence holding the answer (to locate its tokens).
    """

    task: str
    length: int
    seed: int
    depth: float
    prompt: str
    answer: str
    needle_text: str


def _insert(text: str, sentence: str, depth: float) -> str:
    """Insert ``sentence`` as its own paragraph at the sentence boundary nearest ``depth``
    (fraction of characters)."""
    at = int(len(text) * depth)
    cut = text.rfind(". ", 0, at)
    cut = cut + 2 if cut >= 0 else 0
    return text[:cut].rstrip() + "\n\n" + sentence + "\n\n" + text[cut:].lstrip()


def make_case(tokenizer, task: str, length: int, seed: int, depth: float) -> NeedleCase:
    """A case whose prompt is about ``length`` tokens (haystack + preamble + question)."""
    if task not in TASKS:
        raise ValueError(f"unknown needle task {task!r}; choose one of {TASKS}")
    rng = random.Random(seed)
    start = rng.randrange(len(essays()))
    body = haystack(tokenizer, max(64, length - 160), start_essay=start)
    if task == "passkey":
        answer = str(rng.randrange(10000, 100000))
        needle = f"The pass key is {answer}. Remember it. {answer} is the pass key."
        text = PASSKEY_PREAMBLE + _insert(body, needle, depth)
        prompt = text + "\n\nWhat is the pass key? The pass key is"
    else:
        colours = rng.sample(COLOURS, 3)
        codes = [str(rng.randrange(1000, 10000)) for _ in colours]
        asked = rng.randrange(3)
        depths = [depth if i == asked else rng.uniform(0.05, 0.95) for i in range(3)]
        for colour, code, where in sorted(zip(colours, codes, depths, strict=True), key=lambda x: -x[2]):
            body = _insert(body, f"The secret code of the {colour} door is {code}.", where)
        answer, needle = codes[asked], f"The secret code of the {colours[asked]} door is {codes[asked]}."
        prompt = (
            FACT_PREAMBLE
            + body
            + f"\n\nWhat is the secret code of the {colours[asked]} door? "
            + f"The secret code of the {colours[asked]} door is"
        )
    return NeedleCase(task, length, seed, depth, prompt, answer, needle)


def make_cases(tokenizer, length: int, count: int, seed: int = 0) -> list[NeedleCase]:
    """``count`` cases at ``length`` tokens: tasks follow :data:`TASK_CYCLE`, depths spread evenly
    over (0.05, 0.95)."""
    cases = []
    for i in range(count):
        depth = 0.05 + 0.9 * ((i * 7) % count + 0.5) / count  # spread, not in index order
        cases.append(
            make_case(tokenizer, TASK_CYCLE[i % len(TASK_CYCLE)], length, seed * 100003 + length + i, depth)
        )
    return cases


def prompt_ids(tokenizer, case: NeedleCase) -> list[int]:
    """The case's prompt as plain text (no chat template: see the module docstring)."""
    return build_layout(tokenizer, case.prompt, None, [], use_chat_template=False).token_ids


def find_subsequence(haystack_ids: list[int], needle_ids: list[int]) -> list[int]:
    """Start indices of every occurrence of ``needle_ids`` in ``haystack_ids``."""
    n = len(needle_ids)
    if n == 0:
        return []
    first = needle_ids[0]
    return [i for i, t in enumerate(haystack_ids) if t == first and haystack_ids[i : i + n] == needle_ids]


def answer_rows(tokenizer, prompt_ids: list[int], answer: str) -> list[int]:
    """Prompt rows holding the answer's tokens (every occurrence; the question never contains it)."""
    rows: list[int] = []
    for variant in (answer, " " + answer):
        ids = tokenizer(variant, add_special_tokens=False)["input_ids"]
        for start in find_subsequence(prompt_ids, ids):
            rows.extend(range(start, start + len(ids)))
        if rows:
            break
    return sorted(set(rows))
