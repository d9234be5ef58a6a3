"""The bench report writers: the JSON record, the Markdown table and the PNG plots every suite writes.

Injected: rows with floats (small, large), ints, strings, a missing cell and a column subset; a sweep
of two series. Must happen: the JSON holds the suite name, config, environment, every row and the
extra fields as given; the Markdown is the header plus the table with formatted cells in column
order; the plot is a real PNG of the configured size.
"""

from __future__ import annotations

import json
import math
import struct

import torch

from semkv.bench.report import environment, line_plot, markdown_table, median, write_results

ROWS = [
    {"policy": "keykey", "budget": 0.1, "ms": 12.345678, "bytes": 123456789.0, "solved": 16},
    {"policy": "dense", "budget": 1.0, "ms": 20.0, "solved": 17},
]


def test_median():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0]) == 2.5
    assert math.isnan(median([]))


def test_markdown_table_formats_cells_in_column_order():
    table = markdown_table(ROWS, ["policy", "ms", "bytes", "solved"])
    assert table == (
        "| policy | ms | bytes | solved |\n"
        "|---|---|---|---|\n"
        "| keykey | 12.35 | 1.235e+08 | 16 |\n"
        "| dense | 20 |  | 17 |\n"  # a missing cell is empty
    )
    assert markdown_table([]) == "(no rows)\n"
    assert markdown_table(ROWS[:1]).splitlines()[0] == "| policy | budget | ms | bytes | solved |"


def test_write_results_json_and_markdown(tmp_path):
    out = tmp_path / "results" / "nested"
    config = {"model": "tiny", "budgets": (0.1, 1.0)}
    json_path, md_path = write_results(
        out, "sparse", ROWS, config, columns=["policy", "solved"], extra={"summary": {"n": 2}}, notes="a note"
    )
    assert (json_path, md_path) == (out / "sparse.json", out / "sparse.md")
    data = json.loads(json_path.read_text())
    assert data["suite"] == "sparse" and data["rows"] == ROWS and data["summary"] == {"n": 2}
    assert data["config"] == {"model": "tiny", "budgets": [0.1, 1.0]}
    assert set(data["environment"]) == {"time", "python", "torch", "threads", "machine"}
    assert data["environment"]["torch"] == torch.__version__
    assert md_path.read_text() == (
        "# semkv bench sparse\n\n"
        'Config: `{"model": "tiny", "budgets": [0.1, 1.0]}`\n\n'
        "| policy | solved |\n|---|---|\n| keykey | 16 |\n| dense | 17 |\n"
        "\na note"
    )


def test_environment_reports_torch_threads():
    assert environment()["threads"] == torch.get_num_threads()


def test_line_plot_writes_a_png_of_the_configured_size(tmp_path):
    path = line_plot(
        tmp_path / "sweep.png",
        {"keykey": ([0.05, 0.1, 0.2], [0.5, 0.8, 0.9]), "quest": ([0.05, 0.1, 0.2], [0.4, 0.7, 0.95])},
        "kv budget",
        "solved",
        "a sweep",
    )
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (768, 504)  # 6.4 x 4.2 inches at 120 dpi
