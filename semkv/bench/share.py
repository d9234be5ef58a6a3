"""SemShareKV on ACLSum paper summarisation: TTFT and quality vs prompt similarity.

Reference prompt: an instruction + a paper (``short``: abstract + introduction +
conclusion, ~1-3K tokens; ``long``: the full text from the paper's S2ORC parse, cut to
``--long-tokens``). It is fully prefilled once and remembered. Targets: a differently
worded instruction (templates placed before or after the document) + the paper with
0/10/30/50% of its sentences replaced (by sentences of another paper) or deleted,
seeded. Every target is served by: full prefill, prefix caching, share (exponential
decay), share (constant ratio, same mean compute), and the paper's elimination baseline
(unmatched tokens dropped). The share rows run with the thresholds off, so the plots
show where quality falls off; a separate column says whether the default thresholds
would refuse. The data is read from the ``aclsum`` package's files (never imported:
its ``__init__`` imports ``sienna``).
"""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from semkv.bench.report import line_plot, median, write_results
from semkv.evaluation.metrics import logit_kl, rouge_l
from semkv.evaluation.papers import (
    REFERENCE_INSTRUCTION,
    TARGET_TEMPLATES,
    cut_to_tokens,
    edit_sentences,
    full_text_sentences,
    load_papers,
    render,
)
from semkv.reuse.lsh import IndexConfig, PromptIndex

log = logging.getLogger(__name__)

METHODS = ["full", "prefix", "share_decay", "share_constant", "elimination"]


# -- measuring ----------------------------------------------------------------------------------------
class PeakRSS:
    """Peak resident memory (MB) above the level at entry, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0.0

    @staticmethod
    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    def __enter__(self) -> PeakRSS:
        self.base = self.rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss_mb() - self.base)
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss_mb() - self.base)


def method_options(method: str, base, num_layers: int) -> dict[str, Any]:
    """generate() options of a method. ``base`` is the default ShareConfig; share rows run with
    its thresholds off; the constant row uses the decay schedule's mean ratio (same compute)."""
    free = replace(base, min_similarity=0.0, min_match_rate=0.0, min_aligned_after_prefix=0)
    if method == "full":
        return {"reuse": "none"}
    if method == "prefix":
        return {"reuse": "prefix"}
    if method == "share_decay":
        return {"reuse": "share", "share": free}
    if method == "share_constant":
        mean_ratio = statistics.fmean(base.ratios(num_layers).values())
        return {"reuse": "share", "share": replace(free, schedule="constant", constant_ratio=mean_ratio)}
    if method == "elimination":
        return {"reuse": "share", "share": replace(free, unmatched="drop")}
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def default_refusal(engine, prompt: str) -> str | None:
    """The reason the default share thresholds refuse ``prompt`` (None = they accept it)."""
    from semkv.request import GenerateRequest

    plan, refusals = engine.plan(GenerateRequest(prompt=prompt, reuse="share"))
    if plan.path == "share":
        return None
    return next((r.reason for r in refusals if r.path == "share"), f"served by {plan.path} instead")


def index_lookup_benchmark(
    tokenizer, documents: list[str], sizes: list[int], queries: int, window: int, seed: int
) -> list[dict[str, Any]]:
    """Median signature and lookup time of the reference index holding ``sizes`` prompts: windows of
    ``window`` tokens from the real documents (many overlap: a realistic load on the buckets); queries
    are edited copies of stored prompts (20% of tokens changed). Compared with a linear scan of
    every stored signature: found_best_rate = the index's top hit is as similar as the scan's best."""
    rng = np.random.default_rng(seed)
    docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in documents]
    docs = [d for d in docs if len(d) > window]
    rows = []
    for size in sizes:
        index = PromptIndex(IndexConfig())
        stored = []
        for i in tqdm(range(size), desc=f"index {size}", leave=False):
            d = docs[int(rng.integers(len(docs)))]
            start = int(rng.integers(len(d) - window))
            ids = d[start : start + window]
            stored.append(ids)
            index.add(f"{i:064x}", ids)
        all_sigs = np.stack([index.signature(ids) for ids in stored])
        sig_ms, query_ms, scan_ms, found = [], [], [], 0
        for _ in range(queries):
            source = int(rng.integers(size))
            target = list(stored[source])
            for pos in rng.choice(window, window // 5, replace=False):
                target[pos] = int(rng.integers(len(tokenizer)))
            t0 = time.perf_counter()
            sig = index.signature(target)
            t1 = time.perf_counter()
            hits = index.query(sig, top=3)
            t2 = time.perf_counter()
            sig_ms.append(1000 * (t1 - t0))
            query_ms.append(1000 * (t2 - t1))
            t3 = time.perf_counter()
            best = float((all_sigs == sig).mean(axis=1).max())  # a linear scan, for comparison
            scan_ms.append(1000 * (time.perf_counter() - t3))
            found += bool(hits) and hits[0].similarity >= best - 1e-9
        rows.append(
            {
                "prompts": size,
                "prompt_tokens": window,
                "signature_ms_median": median(sig_ms),
                "lookup_ms_median": median(query_ms),
                "lookup_ms_p95": float(np.percentile(query_ms, 95)),
                "linear_scan_ms_median": median(scan_ms),
                "found_best_rate": found / queries,  # the index's top hit is as similar as the scan's best
            }
        )
    return rows


# -- the suite -------------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--papers", type=int, default=3, help="papers (from the start of the split)")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--variant", default="long", choices=["short", "long", "both"])
    parser.add_argument("--long-tokens", type=int, default=3500, help="document tokens of the long variant")
    parser.add_argument("--edits", default="0,10,30,50", help="percent of sentences replaced/deleted")
    parser.add_argument("--templates", type=int, default=1, help="target instructions per edit level")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--index-sizes", default="1000,10000", help="stored prompts for the lookup benchmark")
    parser.add_argument("--index-queries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 paper, short variant, edits 0,30, 16 tokens")
    parser.add_argument(
        "--first-hit",
        action="store_true",
        help="the first-hit workload instead of the sweep: per (paper, edit) a fresh reference (its own cache "
        "salt), then share's first hit on it, full prefill, and repeated hits; paired intervals and the "
        "issue's targets (use --long-tokens 2000 --edits 10,30)",
    )
    parser.add_argument("--paper-offset", type=int, default=0, help="first paper of the split used")
    parser.add_argument("--repeats", type=int, default=2, help="first-hit workload: repeated hits timed")
    parser.add_argument(
        "--warmup-papers",
        type=int,
        default=1,
        help="first-hit workload: papers of the train split served (not measured) before the measured ones",
    )
    parser.add_argument(
        "--profile", action="store_true", help="first-hit workload: profile one first and one repeated hit"
    )
    parser.add_argument(
        "--schedules",
        default="",
        help="first-hit workload: sweep share's recompute schedule instead, comma-separated "
        "first_ratio/decay/min_ratio[/layer0_window] (the first is the baseline), e.g. "
        "0.1/0.6/0.01,0.1/0.6/0.01/64; use a dev split (--split val)",
    )


def _targets(args, tokenizer, papers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    variants = ["short", "long"] if args.variant == "both" else [args.variant]
    edits = [int(e) for e in args.edits.split(",") if e.strip()]
    out = []
    for p_index, paper in enumerate(papers):
        donor_paper = papers[(p_index + 1) % len(papers)] if len(papers) > 1 else paper
        for variant in variants:
            if variant == "short":
                sentences = paper["sentences"]
            else:
                sentences = cut_to_tokens(tokenizer, full_text_sentences(paper["id"]), args.long_tokens)
            document = " ".join(sentences)
            reference = render(REFERENCE_INSTRUCTION, "before", document)
            for edit in edits:
                for t in range(args.templates):
                    place, instruction = TARGET_TEMPLATES[(edit // 10 + t + p_index) % len(TARGET_TEMPLATES)]
                    edited, changed = edit_sentences(sentences, edit / 100, donor_paper["sentences"], rng)
                    out.append(
                        {
                            "paper": paper["id"],
                            "variant": variant,
                            "edit_pct": edit,
                            "sentences_changed": changed,
                            "place": place,
                            "reference": reference,
                            "target": render(instruction, place, " ".join(edited)),
                            "summary": paper["summary"],
                        }
                    )
    return out


def run(args) -> int:
    from semkv.config import StoreConfig
    from semkv.engine import Engine
    from semkv.reuse.options import ShareConfig

    if args.schedules and not args.first_hit:
        raise SystemExit("--schedules sweeps the first-hit workload: add --first-hit")
    if args.first_hit:
        from semkv.bench.share_first import run_first_hit

        return run_first_hit(args)
    if args.quick:
        args.papers, args.variant, args.edits, args.max_new_tokens = 1, "short", "0,30", 16
        args.index_sizes, args.index_queries = "1000", 50
    torch.set_num_threads(args.threads or 1)
    # a fresh, in-memory store: only this run's prompts
    engine = Engine.from_args(args, threads=args.threads or 1, store=StoreConfig(disk=False))
    tokenizer = engine.tokenizer
    papers = load_papers(args.split)
    targets = _targets(args, tokenizer, papers[: args.papers])
    methods = [m for m in args.methods.split(",") if m]
    if methods[0] != "full" or any(m not in METHODS for m in methods):
        raise ValueError(f"--methods must start with full and use only {METHODS}")
    base = ShareConfig()
    engine.generate(prompt="Warm-up: say hello.", max_new_tokens=2, store_prompt=False)  # excluded

    rows: list[dict[str, Any]] = []
    remembered: set[str] = set()
    for target in tqdm(targets, desc="share bench"):
        if target["reference"] not in remembered:  # the earlier prompt: fully prefilled, remembered
            engine.generate(prompt=target["reference"], max_new_tokens=1, reuse="none")
            remembered.add(target["reference"])
        refusal = default_refusal(engine, target["target"])
        full = None
        for method in methods:
            options = method_options(method, base, engine.num_layers)
            with PeakRSS() as mem:
                g = engine.generate(
                    prompt=target["target"], max_new_tokens=args.max_new_tokens, store_prompt=False, **options
                )
            full = g if method == "full" else full
            s = g.stats
            rows.append(
                {
                    "paper": target["paper"],
                    "variant": target["variant"],
                    "edit_pct": target["edit_pct"],
                    "place": target["place"],
                    "method": method,
                    "path": s["path"],
                    "prompt_tokens": s["prompt_tokens"],
                    "ttft_s": s["ttft_s"],
                    "ttft_ratio": (full.stats["ttft_s"] / s["ttft_s"]) if full is not None else float("nan"),
                    "rougeL_ref": rouge_l(g.text, target["summary"]),
                    "rougeL_vs_full": rouge_l(g.text, full.text) if full is not None else float("nan"),
                    "kl_first": logit_kl(full.first_logits, g.first_logits)
                    if full is not None
                    else float("nan"),
                    "peak_rss_mb": mem.peak,
                    "match_rate": s.get("share_match_rate", float("nan")),
                    "aligned_rate": s.get("share_aligned_rate", float("nan")),
                    "similarity": s.get("share_similarity", float("nan")),
                    "recompute_frac": s.get("share_recompute_fraction", float("nan")),
                    "lookup_ms": s.get("share_lookup_ms", float("nan")),
                    "reused": s["reused_tokens"],
                    "default_refuses": refusal is not None,
                    "refusal": refusal or "",
                    "text": g.text,
                }
            )
    summary = summarise(rows)
    lookups = index_lookup_benchmark(
        tokenizer,
        [" ".join(p["sentences"]) for p in papers],
        [int(x) for x in args.index_sizes.split(",") if x],
        args.index_queries,
        window=512,
        seed=args.seed,
    )
    out = Path(args.out)
    plots = make_plots(out, summary) + threshold_plot(out, rows, base.min_match_rate)
    notes = targets_check(summary, lookups) + "\n## Reference index lookup\n\n"
    from semkv.bench.report import markdown_table

    notes += markdown_table(lookups) + "\n## Every row\n\n"
    notes += markdown_table(
        [{k: v for k, v in r.items() if k not in ("text", "refusal")} for r in rows],
    )
    config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}
    config["share"] = {k: v for k, v in vars(base).items() if k != "simhash"}
    write_results(
        out,
        "share",
        summary,
        config,
        columns=[
            "variant",
            "edit_pct",
            "method",
            "n",
            "prompt_tokens",
            "ttft_s",
            "ttft_ratio",
            "rougeL_ref",
            "rougeL_vs_full",
            "kl_first",
            "peak_rss_mb",
            "match_rate",
            "recompute_frac",
            "lookup_ms",
            "share_path_rate",
            "default_refuse_rate",
        ],
        extra={"target_rows": rows, "index_lookup": lookups, "plots": [str(p) for p in plots]},
        notes=notes,
    )
    print(notes.split("## Every row")[0])
    print(f"results in {out}/share.json, share.md and {len(plots)} plots")
    return 0


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (variant, edit %, method): medians of speed, means of quality."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["edit_pct"], r["method"]), []).append(r)
    out = []
    for (variant, edit, method), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], METHODS.index(kv[0][2]))
    ):
        out.append(
            {
                "variant": variant,
                "edit_pct": edit,
                "method": method,
                "n": len(rs),
                "prompt_tokens": median([r["prompt_tokens"] for r in rs]),
                "ttft_s": median([r["ttft_s"] for r in rs]),
                "ttft_ratio": median([r["ttft_ratio"] for r in rs]),
                "rougeL_ref": statistics.fmean(r["rougeL_ref"] for r in rs),
                "rougeL_vs_full": statistics.fmean(r["rougeL_vs_full"] for r in rs),
                "kl_first": statistics.fmean(r["kl_first"] for r in rs),
                "peak_rss_mb": median([r["peak_rss_mb"] for r in rs]),
                "match_rate": statistics.fmean(r["match_rate"] for r in rs),
                "recompute_frac": statistics.fmean(r["recompute_frac"] for r in rs),
                "lookup_ms": median([r["lookup_ms"] for r in rs]),
                "share_path_rate": sum(r["path"] == "share" for r in rs) / len(rs),
                "default_refuse_rate": sum(r["default_refuses"] for r in rs) / len(rs),
            }
        )
    return out


def threshold_plot(out: Path, rows: list[dict[str, Any]], threshold: float) -> list[Path]:
    """First-token KL of every share target against its aligned match rate, with the default
    ``min_match_rate`` drawn as a vertical line (targets left of it are refused by default)."""
    paths = []
    for variant in sorted({r["variant"] for r in rows}):
        series = {}
        top = 0.0
        for method in ("share_decay", "share_constant", "elimination"):
            pts = sorted(
                (r["aligned_rate"], r["kl_first"])
                for r in rows
                if r["variant"] == variant and r["method"] == method
            )
            if pts:
                series[method] = ([p[0] for p in pts], [p[1] for p in pts])
                top = max(top, max(p[1] for p in pts))
        series[f"default min_match_rate {threshold}"] = ([threshold, threshold], [0.0, top])
        path = out / f"share_{variant}_kl_vs_match_rate.png"
        line_plot(
            path,
            series,
            "aligned match rate of the target",
            "first-token KL vs full prefill (nats)",
            f"share, {variant} papers: quality vs similarity",
        )
        paths.append(path)
    return paths


def make_plots(out: Path, summary: list[dict[str, Any]]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for variant in sorted({s["variant"] for s in summary}):
        lines = [s for s in summary if s["variant"] == variant]
        refuse_at = min((s["edit_pct"] for s in lines if s["default_refuse_rate"] >= 0.5), default=None)
        note = f" (default threshold refuses from {refuse_at}% edits)" if refuse_at is not None else ""
        for metric, label in (
            ("ttft_ratio", "TTFT speed-up vs full prefill (x)"),
            ("rougeL_ref", "ROUGE-L vs reference summary"),
            ("kl_first", "first-token KL vs full prefill (nats)"),
        ):
            series = {}
            for method in METHODS:
                pts = [(s["edit_pct"], s[metric]) for s in lines if s["method"] == method]
                if pts and not (metric == "kl_first" and method == "full"):
                    series[method] = ([p[0] for p in pts], [p[1] for p in pts])
            path = out / f"share_{variant}_{metric}.png"
            line_plot(
                path, series, "% of sentences replaced or deleted", label, f"share, {variant} papers{note}"
            )
            paths.append(path)
    return paths


def targets_check(summary: list[dict[str, Any]], lookups: list[dict[str, Any]]) -> str:
    """The issue's targets, checked on this run's figures."""
    lines = ["## Targets (this run)\n"]
    by = {(s["variant"], s["edit_pct"], s["method"]): s for s in summary}
    for (variant, edit, method), s in sorted(by.items()):
        if method != "share_decay" or edit > 10 or s["prompt_tokens"] < 3000:
            continue
        full = by.get((variant, edit, "full"))
        delta = s["rougeL_ref"] - full["rougeL_ref"] if full else float("nan")
        lines.append(
            f"- {variant}, {edit}% edited, {s['prompt_tokens']:.0f} tokens: TTFT {s['ttft_ratio']:.2f}x "
            f"(target >= 5x: {'met' if s['ttft_ratio'] >= 5 else 'NOT met'}), ROUGE-L {s['rougeL_ref']:.2f} vs "
            f"full {full['rougeL_ref'] if full else float('nan'):.2f} (delta {delta:+.2f}; target within 1: "
            f"{'met' if abs(delta) <= 1 else 'NOT met'})"
        )
    for row in lookups:
        lines.append(
            f"- index lookup at {row['prompts']} prompts: median {row['lookup_ms_median']:.3f} ms "
            f"(+ signature {row['signature_ms_median']:.3f} ms; target < 5 ms: "
            f"{'met' if row['lookup_ms_median'] + row['signature_ms_median'] < 5 else 'NOT met'})"
        )
    return "\n".join(lines) + "\n"
