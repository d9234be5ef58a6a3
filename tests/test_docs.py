"""The README and docs/ stay what a newcomer can read, and the code's docstrings stay free of run logs.

Checks: the README is at most 250 lines and opens with the two install commands (the ones CI and a
fresh machine run) before any other fenced block; docs/ has its four pages; every relative link in the
README and docs/ names a file that exists; the recorded headline figures are consistent and draw; and no
docstring or comment in semkv/ carries a measurement log (issue, session or run numbers, dated figures,
timings, ratios, intervals), apart from a short allow-list in the files being refactored.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INSTALL = "scripts/install.sh && semkv demo"
INSTALL_DEV = "scripts/install.sh --dev && python -m pytest -q"

# What a measurement log looks like in a docstring or comment.
RUN_LOG_PATTERNS = {
    "issue number": re.compile(r"(?i)\bissues? \d+"),
    "session number": re.compile(r"(?i)\bsessions? \d+"),
    "run number": re.compile(r"(?i)\bruns? \d+\b"),
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "cuda 'untested' note": re.compile(r"(?i)built for, untested|untested on GPU"),
    "timing": re.compile(r"\b\d+(\.\d+)? ?(ms|us)\b"),
    "speed ratio": re.compile(r"\b\d+\.\d+x\b"),
    "interval": re.compile(r"\[[−+-]?\d+\.\d+, [−+-]?\d+\.\d+\]"),
}

# Files the lead is refactoring: their remaining logs are listed here (path, text of the line) and
# removed with the entries. An entry that no longer matches anything is stale and fails the test.
ALLOWED_RUN_LOGS: set[tuple[str, str]] = set()


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            language, body = lines[i][3:].strip(), []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((language, "\n".join(body)))
        i += 1
    return blocks


def prose(text: str) -> str:
    """The Markdown text without its fenced code blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)


def relative_links(path: Path) -> list[str]:
    """Link and image targets in ``path`` that are neither web addresses nor in-page anchors."""
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(path.read_text()))
    return [t for t in targets if not re.match(r"(?i)^(https?:|mailto:|#)", t)]


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; detail belongs in docs/"


def test_readme_opens_with_the_two_install_commands() -> None:
    text = README.read_text()
    blocks = fenced_blocks(text)
    assert blocks[:2] == [("bash", INSTALL), ("bash", INSTALL_DEV)], (
        "the README's first two fenced blocks must be the two install commands, each in its own bash fence"
    )
    # .ci/run takes the test command as the README's first line starting with this (grep -m1)
    first_dev = next(line for line in text.splitlines() if line.startswith("scripts/install.sh --dev"))
    assert first_dev == INSTALL_DEV


def test_docs_has_its_pages() -> None:
    for page in ("design.md", "serving.md", "benchmarks.md", "models.md"):
        assert (DOCS / page).is_file(), f"docs/{page} is missing"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    broken = [t for t in relative_links(path) if not (path.parent / t.split("#")[0]).is_file()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_recorded_figures_have_provenance_and_appear_in_benchmarks_md() -> None:
    records = json.loads((DOCS / "benchmarks.json").read_text())["ttft"]
    page = (DOCS / "benchmarks.md").read_text()
    for record in records:
        assert record["command"].startswith("semkv bench "), record["technique"]
        assert record["n"] >= 1 and re.fullmatch(r"20\d\d-\d\d-\d\d", record["date"]), record["technique"]
        speedup = float(record["speedup"])
        shown = {f"{speedup:.2f}x", f"{speedup:.1f}x"}
        assert any(s in page for s in shown), (
            f"{record['technique']}: {speedup}x is not in docs/benchmarks.md"
        )
        if record.get("interval"):
            lo, hi = record["interval"]
            assert f"[{lo:.2f}, {hi:.2f}]" in page, (
                f"{record['technique']}: its interval is not in benchmarks.md"
            )


def test_summary_plot_draws_the_recorded_figures(tmp_path: Path) -> None:
    from semkv.bench import summary_plot

    args = argparse.Namespace(results=DOCS / "benchmarks.json", out=tmp_path)
    assert summary_plot.run(args) == 0
    png = (tmp_path / "ttft.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_summary_plot_refuses_an_entry_without_provenance(tmp_path: Path) -> None:
    from semkv.bench import summary_plot

    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"ttft": [{"technique": "blend", "model": "m", "speedup": 4.0}]}))
    with pytest.raises(ValueError, match="lacks"):
        summary_plot.load_figures(bad)


def docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every docstring line (module, class, function, and the
    string statements documenting attributes) in a Python file."""
    source = path.read_text()
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        for statement in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                lines = statement.value.value.splitlines()
                found += [(statement.lineno + i, line) for i, line in enumerate(lines)]
    return found


def run_logs() -> list[tuple[str, int, str, str]]:
    """(path, line, kind, text) of every docstring or comment line in semkv/ that looks like a run log."""
    hits = []
    for path in sorted((ROOT / "semkv").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for lineno, text in docstrings_and_comments(path):
            for kind, pattern in RUN_LOG_PATTERNS.items():
                if pattern.search(text):
                    hits.append((rel, lineno, kind, text.strip()))
    return hits


def test_no_run_logs_in_docstrings_or_comments() -> None:
    hits = run_logs()
    unexplained = [
        f"{rel}:{lineno}: {kind}: {text}"
        for rel, lineno, kind, text in hits
        if not any(rel == path and fragment in text for path, fragment in ALLOWED_RUN_LOGS)
    ]
    assert not unexplained, (
        "docstrings and comments say what a thing is and does; figures go to docs/benchmarks.md or "
        "docs/history/:\n" + "\n".join(unexplained)
    )
    stale = [
        entry
        for entry in ALLOWED_RUN_LOGS
        if not any(rel == entry[0] and entry[1] in text for rel, _, _, text in hits)
    ]
    assert not stale, f"allow-list entries that match nothing any more (remove them): {stale}"
