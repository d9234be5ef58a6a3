"""Share's recompute schedule, swept on first hits (``semkv bench share --first-hit --schedules ...``).

How the share defaults (:class:`~semkv.reuse.options.ShareConfig`'s ``first_ratio``, ``decay``,
``min_ratio``) are chosen: on a dev split, every target of the first-hit workload
(:mod:`semkv.bench.share_first`) is served once by full prefill (``--max-new-tokens`` greedy tokens, then
once more for its TTFT) and, per schedule, by share's first hit on a fresh reference (a cache namespace of
its own per target and schedule). Reported per edit level and schedule, with n and 95% paired intervals
over the targets: TTFT speed-up over full prefill, first-token KL to full prefill and ROUGE-L of the text
to full prefill's, each also as a paired difference to the first schedule listed (the baseline), and the
share of row-layers recomputed. A plot puts each schedule's speed-up against its KL.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from semkv.bench.report import markdown_table, median, write_results
from semkv.evaluation.metrics import logit_kl, paired_difference, paired_speedup, rouge_l
from semkv.reuse.options import ShareConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """One exponential recompute schedule: ``first_ratio`` at layer 1, times ``decay`` a layer, floored at
    ``min_ratio``, and the rows layer 0 recomputes (``layer0_window``; 0: every row) (the fields of
    :class:`ShareConfig` of the same names)."""

    first_ratio: float
    decay: float
    min_ratio: float
    layer0_window: int = 0

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """``"first/decay/min"`` or ``"first/decay/min/window"``, e.g. ``"0.1/0.6/0.01"`` or
        ``"0.1/0.6/0.01/64"``; checked as a :class:`ShareConfig` would be."""
        parts = text.strip().split("/")
        if len(parts) not in (3, 4):
            raise ValueError(
                "a schedule is first_ratio/decay/min_ratio[/layer0_window], e.g. 0.1/0.6/0.01 or "
                f"0.1/0.6/0.01/64; got {text!r}"
            )
        try:
            first, decay, floor = (float(p) for p in parts[:3])
            window = int(parts[3]) if len(parts) == 4 else 0
        except ValueError:
            raise ValueError(
                f"a schedule's parts must be numbers (the window a whole one); got {text!r}"
            ) from None
        schedule = cls(first, decay, floor, window)
        schedule.config()  # validates
        return schedule

    @property
    def name(self) -> str:
        base = f"{self.first_ratio:g}/{self.decay:g}/{self.min_ratio:g}"
        return f"{base}/{self.layer0_window}" if self.layer0_window else base

    def config(self) -> ShareConfig:
        return ShareConfig(
            first_ratio=self.first_ratio,
            decay=self.decay,
            min_ratio=self.min_ratio,
            layer0_window=self.layer0_window,
        )


def parse_schedules(text: str) -> list[Schedule]:
    """Comma-separated schedules, the first the baseline; at least one, no repeats."""
    schedules = [Schedule.parse(part) for part in text.split(",") if part.strip()]
    if not schedules:
        raise ValueError("--schedules needs at least one first_ratio/decay/min_ratio")
    names = [s.name for s in schedules]
    if len(set(names)) != len(names):
        raise ValueError(f"--schedules lists a schedule twice: {names}")
    return schedules


def serve_schedules(
    engine, target: dict[str, Any], salt: str, schedules: list[Schedule], max_new_tokens: int
) -> dict[str, Any]:
    """Full prefill of ``target`` once, then each schedule's first hit on a fresh copy of its reference."""
    common = {"store_prompt": False, "max_new_tokens": max_new_tokens}
    full = engine.generate(prompt=target["target"], reuse="none", cache_salt=f"{salt}-full", **common)
    again = engine.generate(
        prompt=target["target"], reuse="none", max_new_tokens=1, store_prompt=False, cache_salt=f"{salt}-full"
    )
    row: dict[str, Any] = {
        "paper": target["paper"],
        "edit_pct": target["edit_pct"],
        "prompt_tokens": full.stats["prompt_tokens"],
        "ttft_full": statistics.fmean([full.stats["ttft_s"], again.stats["ttft_s"]]),
        "schedules": {},
    }
    for schedule in schedules:
        namespace = f"{salt}-{schedule.name}"
        engine.generate(prompt=target["reference"], max_new_tokens=1, reuse="none", cache_salt=namespace)
        hit = engine.generate(
            prompt=target["target"], reuse="share", share=schedule.config(), cache_salt=namespace, **common
        )
        row["schedules"][schedule.name] = {
            "path": hit.stats["path"],
            "ttft": hit.stats["ttft_s"],
            "kl_first": logit_kl(full.first_logits, hit.first_logits),
            "rougeL_vs_full": rouge_l(hit.text, full.text) / 100,
            "recompute_frac": hit.stats.get("share_recompute_fraction", 1.0),
        }
    return row


def summarise(rows: list[dict[str, Any]], schedules: list[Schedule]) -> list[dict[str, Any]]:
    """One line per (edit %, schedule): paired intervals over the targets; differences to the first schedule."""
    base = schedules[0].name
    out = []
    for edit in sorted({r["edit_pct"] for r in rows}):
        rs = [r for r in rows if r["edit_pct"] == edit]
        full = [r["ttft_full"] for r in rs]
        for schedule in schedules:
            mine = [r["schedules"][schedule.name] for r in rs]
            theirs = [r["schedules"][base] for r in rs]
            speed = paired_speedup(full, [m["ttft"] for m in mine])
            kl = paired_difference([m["kl_first"] for m in mine], [t["kl_first"] for t in theirs])
            rouge = paired_difference(
                [m["rougeL_vs_full"] for m in mine], [t["rougeL_vs_full"] for t in theirs]
            )
            out.append(
                {
                    "edit_pct": edit,
                    "schedule": schedule.name,
                    "n": len(rs),
                    "share_taken": sum(m["path"] == "share" for m in mine),
                    "prompt_tokens": median([r["prompt_tokens"] for r in rs]),
                    "speedup_first": speed.ratio,
                    "speedup_first_ci": f"[{speed.low:.2f}, {speed.high:.2f}]",
                    "kl_first": statistics.fmean(m["kl_first"] for m in mine),
                    "kl_vs_base": f"{kl.mean:+.4f} [{kl.low:+.4f}, {kl.high:+.4f}]",
                    "rougeL_vs_full": statistics.fmean(m["rougeL_vs_full"] for m in mine),
                    "rougeL_vs_base": f"{rouge.mean:+.3f} [{rouge.low:+.3f}, {rouge.high:+.3f}]",
                    "recompute_frac": statistics.fmean(m["recompute_frac"] for m in mine),
                }
            )
    return out


def plot(out: Path, summary: list[dict[str, Any]]) -> Path | None:
    """Speed-up against first-token KL, one point per (edit %, schedule)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the bench's tables do not need it
        log.warning("matplotlib is not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for edit in sorted({s["edit_pct"] for s in summary}):
        points = [s for s in summary if s["edit_pct"] == edit]
        ax.scatter(
            [p["kl_first"] for p in points], [p["speedup_first"] for p in points], label=f"{edit}% edits"
        )
        for p in points:
            ax.annotate(p["schedule"], (p["kl_first"], p["speedup_first"]), fontsize=7)
    ax.set_xlabel("first-token KL to full prefill (mean)")
    ax.set_ylabel("first-hit TTFT speed-up over full prefill")
    ax.set_title("share recompute schedules (first / decay / floor)")
    ax.legend()
    path = out / "share_schedules.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_schedules(args, engine, targets: list[dict[str, Any]], schedules: list[Schedule]) -> int:
    """Serve every target under every schedule; write the table, the JSON and a plot."""
    rows = [
        serve_schedules(engine, target, f"schedules-{args.seed}-{i}", schedules, args.max_new_tokens)
        for i, target in enumerate(tqdm(targets, desc="share schedules"))
    ]
    summary = summarise(rows, schedules)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    picture = plot(out, summary)
    config = {k: v for k, v in vars(args).items() if k not in ("bench_run", "func")}
    write_results(out, "share_schedules", summary, config, extra={"target_rows": rows})
    print(markdown_table(summary))
    print(
        f"results in {out}/share_schedules.json and share_schedules.md"
        + (f", plot {picture}" if picture else "")
    )
    return 0
