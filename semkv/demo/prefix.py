"""Demo scene: a long essay asked two questions — full prefill vs exact prefix reuse."""

from __future__ import annotations

from semkv.evaluation.essays import essay_text, text_of_tokens

TITLE = "exact prefix reuse on a Paul Graham essay"
QUESTIONS = [
    "What is the main point of this essay? Answer in one sentence.",
    "According to the essay, what should founders do? Answer briefly.",
]


def run(engine) -> dict:
    document = text_of_tokens(engine.tokenizer, essay_text("founders"), 1800)
    print(f"document: Paul Graham, 'founders' ({len(engine.tokenizer(document)['input_ids'])} tokens)")
    rows = []
    for number, question in enumerate(QUESTIONS, 1):
        prompt = f"{document}\n\n{question}"
        full = engine.generate(prompt=prompt, max_new_tokens=40, reuse="none")
        reused = engine.generate(prompt=prompt, max_new_tokens=40, reuse="prefix")
        ratio = full.stats["ttft_s"] / reused.stats["ttft_s"]
        same = full.token_ids == reused.token_ids
        rows.append(
            {
                "question": question,
                "ttft_full_s": full.stats["ttft_s"],
                "ttft_prefix_s": reused.stats["ttft_s"],
                "speedup": ratio,
                "identical": same,
                "reused_tokens": reused.stats["reused_tokens"],
            }
        )
        print(f"\nQ{number}: {question}")
        print(
            f"  full prefill : TTFT {full.stats['ttft_s']:.3f} s  ({full.stats['prompt_tokens']} tokens computed)"
        )
        print(
            f"  prefix reuse : TTFT {reused.stats['ttft_s']:.3f} s  ({reused.stats['reused_tokens']} tokens reused, "
            f"{reused.stats['recomputed_tokens']} computed)  -> {ratio:.1f}x faster"
        )
        print(f"  answers identical: {'yes' if same else 'NO'}")
        print(f"  answer: {reused.text.strip()}")
    return {"rows": rows}
