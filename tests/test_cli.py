"""``semkv generate`` with context files (``--chunk-file``), in-process against a tiny checkpoint.

Injected: two UTF-8 context documents given as ``--chunk-file`` (twice, the second time in the other
order) with ``--reuse blend``. Must happen: the chunks are laid out before the question (the prompt
holds their tokens), the first run computes them in place and answers as full prefill does, and stores
them; the second run blends both from the store; the stats go to stderr as JSON, the text to stdout.
"""

from __future__ import annotations

import json

import pytest

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.prompt import build_layout
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import run_cli

DOCS = [
    "The lighthouse keeper of the island counted ships every night and wrote their names in a blue book.",
    "Her brother repaired nets on the pier and sold smoked fish to the travellers every Sunday morning.",
]
QUESTION = "Who repaired the nets?"


@pytest.fixture
def checkpoint(tmp_path, tokenizer):
    folder = tmp_path / "tiny-llama"
    tiny_hf_model("llama", len(tokenizer), num_hidden_layers=4).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def generate(checkpoint, home, files, capsys) -> tuple[str, dict]:
    argv = ["generate", QUESTION, "--model", str(checkpoint), "--home", str(home), "--block-size", "4"]
    argv += ["--reuse", "blend", "--max-new-tokens", "4"]
    for f in files:
        argv += ["--chunk-file", str(f)]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    return out, json.loads(err[err.index("{") :])


def test_generate_with_chunk_files(tmp_path, checkpoint, tokenizer, capsys):
    files = []
    for i, text in enumerate(DOCS):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(text, encoding="utf-8")
    home = tmp_path / "home"
    out, stats = generate(checkpoint, home, files, capsys)
    assert stats["prompt_tokens"] == len(build_layout(tokenizer, prompt=QUESTION, chunks=DOCS))
    assert stats["path"] == "blend" and (stats["chunk_hits"], stats["chunk_misses"]) == (0, 2)

    loaded = Engine.from_pretrained(
        str(checkpoint), home=tmp_path / "ref", block_size=4, store=StoreConfig(disk=False)
    )  # the CLI's defaults otherwise (KV float16)
    full = loaded.generate(prompt=QUESTION, chunks=DOCS, max_new_tokens=4, reuse="none")
    assert out == full.text + "\n"  # chunks computed in place: exactly full prefill

    # the other order: the stored prefix blocks end at the template, both chunks come from the store
    _, stats = generate(checkpoint, home, files[::-1], capsys)
    assert stats["path"] == "blend" and (stats["chunk_hits"], stats["chunk_misses"]) == (2, 0)
    assert stats["reused_tokens"] > 0


def test_generate_sparse_reselection_period(tmp_path, checkpoint, capsys):
    """``--sparse-reselect-every K`` reaches the request's decoder (its stats report K); K = 0 is refused
    with a message naming the option, before the model loads."""
    argv = ["generate", QUESTION, "--model", str(checkpoint), "--home", str(tmp_path / "home")]
    argv += ["--block-size", "4", "--max-new-tokens", "6", "--sparse", "keykey", "--kv-budget", "0.1"]
    code, _, err = run_cli([*argv, "--sparse-reselect-every", "2"], capsys)
    assert code == 0, err
    assert json.loads(err[err.index("{") :])["sparse_reselect_every"] == 2
    code, _, err = run_cli([*argv, "--sparse-reselect-every", "0"], capsys)
    assert code != 0 and "sparse_reselect_every" in err


def test_page_pool_size_reaches_the_engine_and_bad_sizes_are_refused():
    """``--page-pool-mib N`` becomes the engine's ``page_pool_bytes`` (N MiB; 0 turns the pool off); a
    negative or non-integer size is an argparse error naming the value, before any model loads."""
    from semkv.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--page-pool-mib", "0"])
    assert args.page_pool_mib == 0
    args = build_parser().parse_args(["generate", "hi", "--page-pool-mib", "64"])
    assert args.page_pool_mib == 64
    for bad in ("-1", "1.5", "lots"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "hi", "--page-pool-mib", bad])


def test_page_pool_bytes_is_validated():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="page_pool_bytes"):
            EngineConfig(page_pool_bytes=bad)
