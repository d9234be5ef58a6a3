"""Draw the headline TTFT picture (each prefill path against full prefill) from a recorded results file.

Reads ``docs/benchmarks.json`` (or ``--results``): a list of measured TTFT speed-ups, each with the
command that measured it, its sample size, interval and date. Runs no model and times nothing; it writes
``<out>/ttft.png``, a horizontal bar per entry on a log axis with full prefill as the 1x line, and the
entries' provenance in a caption under the plot.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.json"
INSIDE_FROM = 12.0  # speed-ups from here on are labelled inside their bar
MODEL_COLOURS = {"SmolLM2-135M": "#4C72B0", "Gemma 3 270M": "#DD8452"}


@dataclass(frozen=True)
class TTFTFigure:
    """One recorded TTFT speed-up over full prefill on the same prompts."""

    technique: str
    model: str
    speedup: float
    interval: tuple[float, float] | None
    n: int
    unit: str
    date: str
    command: str
    speedup_high: float | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TTFTFigure:
        """Build one from an entry of the results file's ``ttft`` list; raises ``ValueError`` on a bad one."""
        missing = [
            k for k in ("technique", "model", "speedup", "n", "unit", "date", "command") if k not in record
        ]
        if missing:
            raise ValueError(f"results entry {record.get('technique', '?')!r} lacks {', '.join(missing)}")
        interval = record.get("interval")
        return cls(
            technique=str(record["technique"]),
            model=str(record["model"]),
            speedup=float(record["speedup"]),
            interval=(float(interval[0]), float(interval[1])) if interval else None,
            n=int(record["n"]),
            unit=str(record["unit"]),
            date=str(record["date"]),
            command=str(record["command"]),
            speedup_high=float(record["speedup_high"]) if record.get("speedup_high") else None,
        )

    def label(self) -> str:
        """The figure as printed beside its bar: speed-up, its interval when recorded, n, unit and date."""
        if self.interval:
            value = f"{self.speedup:.2f}x [{self.interval[0]:.2f}, {self.interval[1]:.2f}]"
        elif self.speedup_high:
            value = f"{self.speedup:.1f}-{self.speedup_high:.1f}x"
        else:
            value = f"{self.speedup:.2f}x"
        return f"{value}, n={self.n} {self.unit}, {self.date}"


def load_figures(path: Path) -> list[TTFTFigure]:
    """Read the ``ttft`` entries of a results file."""
    data = json.loads(Path(path).read_text())
    figures = [TTFTFigure.from_record(r) for r in data.get("ttft", [])]
    if not figures:
        raise ValueError(f"{path} has no 'ttft' entries")
    return figures


def draw(figures: list[TTFTFigure], out_path: Path, source: str) -> Path:
    """Write the PNG: one bar per figure (speed-up over full prefill, log axis), 95% intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 0.48 * len(figures) + 2.2))
    ys = list(range(len(figures)))[::-1]
    for y, f in zip(ys, figures, strict=True):
        colour = MODEL_COLOURS.get(f.model, "#55A868")
        ax.barh(y, f.speedup, color=colour, height=0.6)
        if f.interval:
            lo, hi = f.interval
            ax.errorbar(
                f.speedup, y, xerr=[[f.speedup - lo], [hi - f.speedup]], fmt="none", ecolor="black", capsize=3
            )
        if f.speedup >= INSIDE_FROM:  # a long bar carries its label inside, so the axis stays short
            ax.text(f.speedup * 0.96, y, f.label(), va="center", ha="right", fontsize=7.5, color="white")
        else:
            ax.text(f.speedup * 1.04, y, f.label(), va="center", fontsize=7.5)
    ax.set_yticks(ys, [f"{f.technique}\n{f.model}" for f in figures], fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(0.9, max(40.0, max(f.speedup for f in figures) * 1.3))
    ax.set_xticks([1, 2, 4, 8, 16, 32], ["1x\n(full prefill)", "2x", "4x", "8x", "16x", "32x"], fontsize=8)
    ax.set_xlabel("time to first token: full prefill / this path (higher is faster)")
    ax.set_title(
        "TTFT of each prefill path against full prefill on the same prompts (CPU, 2 cores)", fontsize=10
    )
    ax.grid(axis="x", alpha=0.3)
    fig.text(
        0.01,
        0.01,
        f"Figures from {source}, copied by hand from the measured runs it names (command, n, date per entry);\n"
        "bars with whiskers: paired geometric mean and its 95% interval; others: ratio of medians.",
        fontsize=7,
        va="bottom",
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--results",
        type=Path,
        default=DEFAULT_RESULTS,
        help="recorded results file with a 'ttft' list (default: the checkout's docs/benchmarks.json)",
    )
    parser.set_defaults(no_lock=True)  # draws recorded figures: no model, no timing


def run(args: argparse.Namespace) -> int:
    figures = load_figures(args.results)
    try:
        source = str(Path(args.results).resolve().relative_to(Path.cwd()))
    except ValueError:
        source = str(args.results)
    path = draw(figures, Path(args.out) / "ttft.png", source)
    print(f"wrote {path} ({len(figures)} figures from {source})")
    return 0
