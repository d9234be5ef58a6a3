"""``semkv bench gpu --device cpu --shape tiny`` runs every path, so its CPU run cannot rot.

Injected: nothing; the real command (in process) with its own random-weight tiny Llama and the suite's
tokenizer (SmolLM2's, or the tiny local one without the model package), quality-only (``--lock shared``).
Must happen: it exits 0, prints its table, and writes one JSON row per path with every row ok: the fp32
logits within 5e-3 of HF and the greedy tokens equal, the prefix hits from the memory and the disk tier,
blend with every row selector, share, every sparse policy, sampling, batching at 1, 16 and 64 sequences,
and one chat request to the server (where fastapi is missing, that row says so and is the one allowed
not to be ok).
"""

from __future__ import annotations

import importlib.util
import json

from semkv.cli import main
from semkv.reuse.selection.registry import SELECTORS
from semkv.sparse import POLICIES


def test_every_path_of_the_tiny_shape_on_cpu(tmp_path, tokenizer, capsys):
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    out = tmp_path / "out"
    argv = ["bench", "gpu", "--device", "cpu", "--shape", "tiny", "--tokenizer", str(tokenizer_dir)]
    argv += ["--out", str(out), "--home", str(tmp_path / "home"), "--lock", "shared"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| path | ok | seconds | result |" in printed
    report = json.loads((out / "gpu-tiny-cpu.json").read_text())
    rows = {row["path"]: row for row in report["rows"]}
    expected = {"checkpoint", "load", "exact_fp32", "prefill_vs_hf", "decode_vs_hf", "prefix_memory"}
    expected |= {"prefix_disk", "share", "sampling", "server", "batching_1", "batching_16", "batching_64"}
    expected |= {f"blend_{name}" for name in SELECTORS} | {f"sparse_{name}" for name in POLICIES}
    assert expected <= set(rows), sorted(expected - set(rows))
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        assert rows.pop("server")["reason"] == "fastapi not installed"
    failed = {path: row for path, row in rows.items() if not row["ok"]}
    assert not failed, failed
    assert rows["exact_fp32"]["max_abs_logit_diff"] <= 5e-3
    assert rows["prefix_disk"]["reused_tokens"] > 0 and rows["prefix_disk"]["tokens_equal"]
