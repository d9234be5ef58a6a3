"""Writing results: JSON for machines, Markdown tables for people, PNG plots for sweeps."""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def environment() -> dict[str, Any]:
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_results(
    out_dir: str | Path,
    name: str,
    rows: Sequence[dict[str, Any]],
    config: dict[str, Any],
    columns: Sequence[str] | None = None,
    extra: dict[str, Any] | None = None,
    notes: str = "",
) -> tuple[Path, Path]:
    """Write ``<out>/<name>.json`` (config, environment, rows, extra) and ``<out>/<name>.md``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "suite": name,
        "config": config,
        "environment": environment(),
        "rows": list(rows),
        **(extra or {}),
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(payload, indent=2, default=str))
    md_path = out / f"{name}.md"
    header = f"# semkv bench {name}\n\nConfig: `{json.dumps(config, default=str)}`\n\n"
    md_path.write_text(header + markdown_table(rows, columns) + ("\n" + notes if notes else ""))
    log.info("wrote %s and %s", json_path, md_path)
    return json_path, md_path


def line_plot(
    path: str | Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path:
    """One PNG with a line per series: name -> (xs, ys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
