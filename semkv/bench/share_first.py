"""SemShareKV's first hit on a reference vs a repeated hit vs full prefill (``semkv bench share --first-hit``).

Per (paper, edit level), in a cache namespace of its own (a fresh cache salt, so nothing of an earlier
target is reused and the reference is new to the share index): the reference prompt (the bench's
instruction + the paper cut to ``--long-tokens``) is fully prefilled and remembered; then the target (a
reworded instruction, placed before or after, + the paper with ``--edits`` % of its sentences replaced or
deleted) is served by

1. share, the first hit on that reference (the default :class:`ShareConfig`, thresholds on: a refusal
   counts as a miss and is reported), ``--max-new-tokens`` greedy tokens;
2. full prefill (``reuse="none"``), the same tokens, then once more for its TTFT (the two TTFTs averaged);
3. share again, ``--repeats`` times (one token each): the repeated hit.

Reported per edit level, with n and 95% paired intervals (Student t over the targets): TTFT speed-up of
the first and of the repeated hit over full prefill (geometric means), first / repeat, and ROUGE-L of the
first hit's text to full prefill's (on 0..1). ``--warmup-papers`` papers of the train split are served first (not
measured): a process that has served a few prompts, with the matmul kernels of the common row buckets
built. ``--profile`` adds a cProfile and a torch operator profile of one first and one repeated hit.
``--schedules`` sweeps share's recompute schedule over the same targets instead
(:mod:`semkv.bench.share_schedules`).
"""

from __future__ import annotations

import cProfile
import io
import logging
import math
import pstats
import random
import statistics
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from semkv.bench.report import markdown_table, median, write_results
from semkv.evaluation.metrics import logit_kl, paired_difference, paired_speedup, rouge_l
from semkv.evaluation.papers import (
    REFERENCE_INSTRUCTION,
    TARGET_TEMPLATES,
    cut_to_tokens,
    edit_sentences,
    full_text_sentences,
    load_papers,
    render,
)

log = logging.getLogger(__name__)

TARGETS = {10: (5.0, 0.7), 30: (4.0, None)}  # edit % -> (min first-hit speed-up, min mean ROUGE-L to full)
MAX_FIRST_OVER_REPEAT = 1.3


def make_targets(
    tokenizer,
    papers: list[dict[str, Any]],
    donors: list[dict[str, Any]],
    edits: list[int],
    tokens: int,
    seed: int,
) -> list[dict[str, Any]]:
    """One target per (paper, edit %): reference and edited prompt (template rotated by paper and edit)."""
    rng = random.Random(seed)
    out = []
    for p_index, paper in enumerate(papers):
        sentences = cut_to_tokens(tokenizer, full_text_sentences(paper["id"]), tokens)
        reference = render(REFERENCE_INSTRUCTION, "before", " ".join(sentences))
        donor = donors[p_index % len(donors)]
        for e_index, edit in enumerate(edits):
            place, instruction = TARGET_TEMPLATES[(p_index + e_index) % len(TARGET_TEMPLATES)]
            edited, changed = edit_sentences(sentences, edit / 100, donor["sentences"], rng)
            out.append(
                {
                    "paper": paper["id"],
                    "edit_pct": edit,
                    "place": place,
                    "sentences_changed": changed,
                    "reference": reference,
                    "target": render(instruction, place, " ".join(edited)),
                }
            )
    return out


def serve_target(
    engine, target: dict[str, Any], salt: str, max_new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Remember the reference in namespace ``salt``, then time share's first hit, full prefill and repeats."""
    common = {"store_prompt": False, "cache_salt": salt}
    engine.generate(prompt=target["reference"], max_new_tokens=1, reuse="none", cache_salt=salt)
    first = engine.generate(prompt=target["target"], max_new_tokens=max_new_tokens, reuse="share", **common)
    full = engine.generate(prompt=target["target"], max_new_tokens=max_new_tokens, reuse="none", **common)
    full_again = engine.generate(prompt=target["target"], max_new_tokens=1, reuse="none", **common)
    again = [
        engine.generate(prompt=target["target"], max_new_tokens=1, reuse="share", **common)
        for _ in range(repeats)
    ]
    s = first.stats
    ttft_full = statistics.fmean([full.stats["ttft_s"], full_again.stats["ttft_s"]])
    ttft_repeat = median([g.stats["ttft_s"] for g in again])
    return {
        "paper": target["paper"],
        "edit_pct": target["edit_pct"],
        "place": target["place"],
        "prompt_tokens": s["prompt_tokens"],
        "path": s["path"],
        "repeat_path": again[0].stats["path"] if again else "",
        "ttft_full": ttft_full,
        "ttft_share_first": s["ttft_s"],
        "ttft_share_repeat": ttft_repeat,
        "speedup_first": ttft_full / s["ttft_s"],
        "speedup_repeat": ttft_full / ttft_repeat,
        "first_over_repeat": s["ttft_s"] / ttft_repeat,
        "rougeL_vs_full": rouge_l(first.text, full.text) / 100,  # rouge_l is x100; the target is on 0..1
        "kl_first": logit_kl(full.first_logits, first.first_logits),
        "same_text": first.text == full.text,
        "aligned_rate": s.get("share_aligned_rate", float("nan")),
        "recompute_frac": s.get("share_recompute_fraction", float("nan")),
        "forced": s.get("share_forced", 0),
        "plan_ms": s.get("share_lookup_ms", 0.0) + s.get("share_match_ms", 0.0),
        "refused": "" if s["path"] == "share" else str(s.get("refused", {}).get("share", "")),
        "text": first.text,
        "full_text": full.text,
    }


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per edit %: paired intervals over the targets (speed-ups over the same targets' full prefill)."""
    out = []
    for edit in sorted({r["edit_pct"] for r in rows}):
        rs = [r for r in rows if r["edit_pct"] == edit]
        full = [r["ttft_full"] for r in rs]
        first = paired_speedup(full, [r["ttft_share_first"] for r in rs])
        repeat = paired_speedup(full, [r["ttft_share_repeat"] for r in rs])
        over = paired_speedup([r["ttft_share_first"] for r in rs], [r["ttft_share_repeat"] for r in rs])
        rouge = paired_difference([r["rougeL_vs_full"] for r in rs], [0.0] * len(rs))
        out.append(
            {
                "edit_pct": edit,
                "n": len(rs),
                "prompt_tokens": median([r["prompt_tokens"] for r in rs]),
                "share_taken": sum(r["path"] == "share" for r in rs),
                "ttft_full": median(full),
                "ttft_share_first": median([r["ttft_share_first"] for r in rs]),
                "ttft_share_repeat": median([r["ttft_share_repeat"] for r in rs]),
                "speedup_first": first.ratio,
                "speedup_first_ci": f"[{first.low:.2f}, {first.high:.2f}]",
                "speedup_repeat": repeat.ratio,
                "speedup_repeat_ci": f"[{repeat.low:.2f}, {repeat.high:.2f}]",
                "first_over_repeat": over.ratio,
                "first_over_repeat_ci": f"[{over.low:.2f}, {over.high:.2f}]",
                "rougeL_vs_full": rouge.mean,
                "rougeL_vs_full_ci": f"[{rouge.low:.2f}, {rouge.high:.2f}]",
                "kl_first": statistics.fmean(r["kl_first"] for r in rs),
                "same_text": sum(r["same_text"] for r in rs),
                "recompute_frac": statistics.fmean(r["recompute_frac"] for r in rs),
                "_speedup_low": first.low,
                "_over_high": over.high,
                "_rouge_low": rouge.low,
            }
        )
    return out


def targets_check(summary: list[dict[str, Any]]) -> str:
    """The issue's share targets on this run: point estimate and interval bound, both named."""
    lines = ["## Targets (this run)\n"]
    for s in summary:
        want = TARGETS.get(s["edit_pct"])
        head = f"- {s['edit_pct']}% edits, n={s['n']}, ~{s['prompt_tokens']:.0f} tokens:"
        if want is not None:
            speed, rouge = want
            verdict = "met" if s["speedup_first"] >= speed else "NOT met"
            lines.append(
                f"{head} first-hit TTFT {s['speedup_first']:.2f}x {s['speedup_first_ci']} vs full prefill "
                f"(target >= {speed:g}x: {verdict}; interval's low end {s['_speedup_low']:.2f})"
            )
            if rouge is not None:
                verdict = "met" if s["rougeL_vs_full"] >= rouge else "NOT met"
                lines.append(
                    f"{head} ROUGE-L to full prefill {s['rougeL_vs_full']:.3f} {s['rougeL_vs_full_ci']} "
                    f"(target mean >= {rouge}: {verdict})"
                )
        verdict = "met" if s["first_over_repeat"] <= MAX_FIRST_OVER_REPEAT else "NOT met"
        lines.append(
            f"{head} first hit / repeated hit {s['first_over_repeat']:.2f}x {s['first_over_repeat_ci']} "
            f"(target <= {MAX_FIRST_OVER_REPEAT}: {verdict}; interval's high end {s['_over_high']:.2f}); "
            f"share taken {s['share_taken']}/{s['n']}"
        )
    return "\n".join(lines) + "\n"


def profile_hits(engine, target: dict[str, Any], salt: str, out: Path) -> str:
    """cProfile + torch operator table of a first hit and a repeated hit of ``target`` (a fresh namespace)."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate(prompt=target["reference"], max_new_tokens=1, reuse="none", cache_salt=salt)
    text = []
    for label in ("first hit", "repeated hit"):
        py = cProfile.Profile()
        with profile(activities=[ProfilerActivity.CPU]) as ops:
            py.enable()
            g = engine.generate(
                prompt=target["target"], max_new_tokens=1, reuse="share", store_prompt=False, cache_salt=salt
            )
            py.disable()
        stream = io.StringIO()
        pstats.Stats(py, stream=stream).sort_stats("cumulative").print_stats(40)
        text.append(
            f"### {label}: TTFT {g.stats['ttft_s']:.3f} s (path {g.stats['path']}, "
            f"{g.stats['prompt_tokens']} tokens, rows per layer {g.stats.get('share_layer_rows')})\n\n"
            f"```\n{ops.key_averages().table(sort_by='self_cpu_time_total', row_limit=20)}\n```\n\n"
            f"```\n{stream.getvalue()}\n```\n"
        )
    body = "\n".join(text)
    (out / "share_first_hit_profile.md").write_text(body, encoding="utf-8")
    return body


def run_first_hit(args) -> int:
    from semkv.bench.share_schedules import parse_schedules, run_schedules
    from semkv.config import StoreConfig
    from semkv.engine import Engine

    schedules = parse_schedules(args.schedules) if args.schedules else None  # bad input fails before loading
    torch.set_num_threads(args.threads or 1)
    engine = Engine.from_args(args, threads=args.threads or 1, store=StoreConfig(disk=False))
    tokenizer = engine.tokenizer
    edits = [int(e) for e in args.edits.split(",") if e.strip()]
    split = load_papers(args.split)
    papers = split[args.paper_offset : args.paper_offset + args.papers]
    donors = split[args.paper_offset + args.papers :] + split[: args.paper_offset]
    targets = make_targets(tokenizer, papers, donors or papers, edits, args.long_tokens, args.seed)
    engine.generate(prompt="Warm-up: say hello.", max_new_tokens=2, store_prompt=False)
    train = load_papers("train")
    warm = make_targets(
        tokenizer, train[: args.warmup_papers], train[-1:], edits, args.long_tokens, args.seed
    )
    for i, target in enumerate(tqdm(warm, desc="warm-up (not measured)")):
        serve_target(engine, target, f"warmup-{i}", 4, 1)
    if schedules is not None:
        return run_schedules(args, engine, targets, schedules)
    rows = []
    for i, target in enumerate(tqdm(targets, desc="share first hit")):
        rows.append(
            serve_target(engine, target, f"first-hit-{args.seed}-{i}", args.max_new_tokens, args.repeats)
        )
    summary = summarise(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes = targets_check(summary)
    if args.profile and targets:
        notes += "\n## Profile of one first and one repeated hit\n\n" + profile_hits(
            engine, targets[0], f"profile-{args.seed}", out
        )
    notes += "\n## Every target\n\n" + markdown_table(
        [{k: v for k, v in r.items() if k not in ("text", "full_text")} for r in rows]
    )
    config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}
    write_results(
        out,
        "share_first_hit",
        [{k: v for k, v in s.items() if not k.startswith("_")} for s in summary],
        config,
        columns=[
            "edit_pct",
            "n",
            "prompt_tokens",
            "share_taken",
            "ttft_full",
            "ttft_share_first",
            "ttft_share_repeat",
            "speedup_first",
            "speedup_first_ci",
            "speedup_repeat",
            "speedup_repeat_ci",
            "first_over_repeat",
            "first_over_repeat_ci",
            "rougeL_vs_full",
            "rougeL_vs_full_ci",
            "kl_first",
            "same_text",
            "recompute_frac",
        ],
        extra={"target_rows": rows},
        notes=notes,
    )
    print(markdown_table([{k: v for k, v in s.items() if not k.startswith("_")} for s in summary]))
    print(notes.split("## Profile")[0].split("## Every target")[0])
    print(f"results in {out}/share_first_hit.json and share_first_hit.md")
    if not all(math.isfinite(s["speedup_first"]) for s in summary):
        return 1
    return 0
