"""Demo scene: RAG with CacheBlend — Wikipedia paragraphs cached once, a question answered by full prefill
and by blend with each row selector, and the tokens each selector recomputed."""

from __future__ import annotations

import sys

from semkv.evaluation.corpora import load_squad
from semkv.evaluation.hotpotqa import RagCase, squad_case
from semkv.evaluation.metrics import exact_match
from semkv.request import GenerateRequest
from semkv.reuse.options import BlendConfig

TITLE = "CacheBlend: reuse cached documents at any position, recompute ~15% of their tokens"
# A SQuAD question of the dev split (never the test split) that SmolLM2-135M answers under full prefill
# with six paragraphs of its article as chunks: the first such question of the dev split whose answer
# is not already a word of the question (the one before, "sleep deprivation", repeats "deprivation").
QUESTION_ID = "572fec30947a6a140053cdf2"
RATIO = 0.15
MAX_NEW_TOKENS = 24
SELECTORS = ("deviation", "query", "chunk-start")


def demo_case() -> RagCase:
    """The scene's question with six paragraphs of its article (its own among them)."""
    return squad_case(next(item for item in load_squad() if item.id == QUESTION_ID))


def _highlight(tokenizer, token_ids: list[int], chosen: set[int], offset: int, ansi: bool) -> str:
    """The paragraph with the recomputed tokens marked (ANSI reverse video, or [[...]])."""
    out = []
    for i, token in enumerate(token_ids):
        piece = tokenizer.decode([token])
        if offset + i in chosen:
            piece = f"\x1b[7m{piece}\x1b[0m" if ansi else f"[[{piece}]]"
        out.append(piece)
    return "".join(out)


def run(engine) -> dict:
    tokenizer = engine.tokenizer
    case = demo_case()
    chunks, messages = list(case.chunks), case.messages()
    print(f"{len(chunks)} Wikipedia paragraphs (SQuAD), each cached once as a position-independent chunk.")
    engine.add_chunks(chunks)
    print(f"question: {case.question}   (answer in paragraph {case.gold[0] + 1}: {case.answer})")

    full = engine.generate(
        messages=messages, chunks=chunks, reuse="none", max_new_tokens=MAX_NEW_TOKENS, store_prompt=False
    )
    runs = {"full prefill": full}
    for name in SELECTORS:
        config = BlendConfig(RATIO, name)
        runs[f"{name} {RATIO}"] = engine.generate(
            messages=messages,
            chunks=chunks,
            reuse="blend",
            blend=config,
            max_new_tokens=MAX_NEW_TOKENS,
            store_prompt=False,
        )
    base = runs["full prefill"].stats["ttft_s"]
    print(f"\n{'':18}{'TTFT':>8}  {'speed-up':>8}  {'recomputed':>10}  correct  answer")
    correct = {}
    for label, g in runs.items():
        correct[label] = exact_match(g.text, case.answer)
        print(
            f"{label:18}{g.stats['ttft_s']:7.2f}s  {base / g.stats['ttft_s']:7.1f}x  "
            f"{g.stats['recomputed_tokens']:>10}  {'yes' if correct[label] else 'no':>7}  {g.text.strip()!r}"
        )

    layout = engine.layout(GenerateRequest(messages=messages, chunks=chunks))
    spans = layout.chunk_spans()
    seg, start, end = spans[case.gold[0]]
    ansi = sys.stdout.isatty()
    mark = "reverse video" if ansi else "[[double brackets]]"
    print(f"\ntokens each selector recomputed in the paragraph holding the answer ({mark}):")
    for label, g in runs.items():
        if label == "full prefill":
            continue
        chosen = set(g.stats.get("recomputed_rows", []))
        inside = sum(1 for _, s, e in spans for r in range(s, e) if r in chosen)
        here = sum(1 for r in range(start, end) if r in chosen)
        first8 = sum(1 for _, s, e in spans for r in range(s, min(e, s + 8)) if r in chosen)
        print(
            f"\n--- {label}: {inside} chunk tokens recomputed, {here} of them in this paragraph "
            f"({end - start} tokens), {first8} among chunks' first 8 ---"
        )
        print(_highlight(tokenizer, seg.token_ids, chosen, start, ansi))
    return {
        "question_id": QUESTION_ID,
        "ttft_s": {label: g.stats["ttft_s"] for label, g in runs.items()},
        "answers": {label: g.text for label, g in runs.items()},
        "correct": correct,
        "speedup": {label: base / g.stats["ttft_s"] for label, g in runs.items()},
        "recomputed_tokens": {label: g.stats["recomputed_tokens"] for label, g in runs.items()},
        "prompt_tokens": full.stats["prompt_tokens"],
    }
