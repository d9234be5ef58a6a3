"""Demo scene: a paraphrased request served from an earlier prompt's cache (SemShareKV)."""

from __future__ import annotations

from semkv.evaluation.metrics import logit_kl, rouge_l

TITLE = "semantic sharing: a paraphrased request reuses an earlier prompt's KV (SemShareKV)"

EARLIER = "Summarize the following paper: the challenge it addresses, its approach and its outcome."
PARAPHRASE = "Please write a short summary of this paper: what problem it tackles, how, and what it found."


def _paper() -> str:
    from semkv.evaluation.papers import load_papers

    papers = load_papers("test")
    return " ".join(papers[0]["sentences"])


def run(engine) -> dict:
    paper = _paper()
    earlier = f"{EARLIER}\n\n{paper}"
    later = f"{PARAPHRASE}\n\n{paper}"
    print(f"earlier request : {EARLIER!r} + a paper from ACLSum")
    first = engine.generate(prompt=earlier, max_new_tokens=1)
    print(
        f"  {first.stats['prompt_tokens']} tokens, served by {first.stats['path']} in {first.stats['ttft_s']:.2f} s"
        " (its KV and token signatures are remembered)"
    )
    print(f"later request   : {PARAPHRASE!r} + the same paper")
    full = engine.generate(prompt=later, max_new_tokens=40, reuse="none", store_prompt=False)
    shared = engine.generate(prompt=later, max_new_tokens=40, reuse="auto", store_prompt=False)
    s = shared.stats
    speedup = full.stats["ttft_s"] / s["ttft_s"]
    print(f"  full prefill      TTFT {full.stats['ttft_s']:6.2f} s")
    if s["path"] == "share":
        print(
            f"  share (auto)      TTFT {s['ttft_s']:6.2f} s  = {speedup:.1f}x faster; reference {s['share_reference']},"
            f" match rate {s['share_match_rate']:.2f} (aligned {s['share_aligned_rate']:.2f}),"
            f" {100 * s['share_recompute_fraction']:.0f}% of token-layers recomputed"
        )
    else:
        print(f"  auto chose {s['path']} (share refused: {s['refused'].get('share')})")
    kl = logit_kl(full.first_logits, shared.first_logits)
    agreement = rouge_l(shared.text, full.text)
    print(f"  first-token KL {kl:.4f} nats; ROUGE-L of the two answers {agreement:.1f}")
    print(f"  full prefill answer: {full.text.strip()!r}")
    print(f"  shared KV answer   : {shared.text.strip()!r}")
    return {
        "path": s["path"],
        "prompt_tokens": s["prompt_tokens"],
        "ttft_full_s": full.stats["ttft_s"],
        "ttft_share_s": s["ttft_s"],
        "speedup": speedup,
        "match_rate": s.get("share_match_rate"),
        "first_token_kl": kl,
        "rougeL_share_vs_full": agreement,
    }
