"""ACL papers with reference summaries from the ``aclsum`` package (read from its files, never imported:
its ``__init__`` imports ``sienna``), and the edits and instructions the share workload applies to them."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from semkv.models.loader import package_folder

REFERENCE_INSTRUCTION = (
    "Summarize the following scientific paper in a few sentences: the challenge it addresses, "
    "its approach and its outcome."
)
TARGET_TEMPLATES: list[tuple[str, str]] = [
    ("before", "Write a short summary of the paper below, covering the problem, the method and the results."),
    (
        "after",
        "Summarise this paper in a few sentences: what problem does it tackle, how, and what did it find?",
    ),
    ("before", "Please read this ACL paper and give a brief summary of it."),
    ("after", "Give a concise abstract-style summary of the paper above."),
]
SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")


def aclsum_folder() -> Path:
    return package_folder("aclsum") / "dataset"


def load_papers(split: str = "test") -> list[dict[str, Any]]:
    """Papers of one split: id, title, sentences (abstract + introduction + conclusion), summary."""
    papers = []
    with open(aclsum_folder() / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            x = json.loads(line)
            sections = x["sentences"]
            sentences = [
                s for part in ("abstract", "introduction", "conclusion") for s in sections.get(part, [])
            ]
            summary = " ".join(x["summary"][aspect] for aspect in ("challenge", "approach", "outcome"))
            papers.append({"id": x["id"], "sentences": sentences, "summary": summary})
    return papers


def full_text_sentences(paper_id: str) -> list[str]:
    """Sentences of the paper's full text (abstract + body paragraphs of its S2ORC parse)."""
    data = json.loads((aclsum_folder() / "paper_jsons" / f"{paper_id}.json").read_text(encoding="utf-8"))
    parse = data.get("pdf_parse") or {}
    paragraphs = [p["text"] for p in parse.get("abstract", [])] + [
        p["text"] for p in parse.get("body_text", [])
    ]
    return [s.strip() for p in paragraphs for s in SENTENCE_SPLIT.split(p) if s.strip()]


def cut_to_tokens(tokenizer, sentences: list[str], max_tokens: int) -> list[str]:
    """The leading sentences whose total stays within ``max_tokens`` tokens."""
    out, total = [], 0
    for s in sentences:
        n = len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        if total + n > max_tokens:
            break
        out.append(s)
        total += n
    return out


def edit_sentences(
    sentences: list[str], fraction: float, donor: list[str], rng: random.Random
) -> tuple[list[str], int]:
    """Replace (by a donor sentence) or delete, with equal odds, ``fraction`` of the sentences."""
    count = round(fraction * len(sentences))
    chosen = set(rng.sample(range(len(sentences)), count))
    out = []
    for i, s in enumerate(sentences):
        if i not in chosen:
            out.append(s)
        elif rng.random() < 0.5:
            out.append(rng.choice(donor))
    return out, count


def render(instruction: str, place: str, document: str) -> str:
    return f"{instruction}\n\n{document}" if place == "before" else f"{document}\n\n{instruction}"
