"""``semkv cache stats`` and ``semkv cache verify`` through the command line.

Injected: a store filled by two ``semkv generate`` runs of the same prompt (the second reuses the
first's blocks), then three entries damaged (a flipped payload byte, truncation to zero, random
garbage) and a temp file of a dead writer left behind.

Must happen: ``cache stats`` reports the entries by kind, the bytes on disk, and hit rates per tier
and for the store summed over both runs (the second run's disk hits show); it reads headers only and
removes nothing. ``cache verify`` checks every entry, reports the three damaged keys with reasons,
moves them to quarantine, leaves every good entry byte-for-byte intact and exits 1; a second verify
finds nothing and exits 0; a later ``generate`` recomputes and rewrites the removed blocks, with the
same output. ``cache clear`` removes the store; a home that is a file is a clean error (exit 2).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from semkv.store.entry import decode
from tests.reliability.reliability_helpers import run_cli, save_tiny_checkpoint

PROMPT = "The store keeps what the engine computed; verify finds what the disk broke."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", tokenizer)


def generate(home, checkpoint, capsys):
    code, out, err = run_cli(
        [
            "generate",
            PROMPT,
            "--model",
            str(checkpoint),
            "--home",
            str(home),
            "--max-new-tokens",
            "3",
            "--block-size",
            "4",
        ],
        capsys,
    )
    assert code == 0, err
    return out


def cache(action, home, capsys):
    code, out, err = run_cli(["cache", action, "--home", str(home)], capsys)
    return code, (json.loads(out) if out.strip() else None), err


def test_stats_and_verify(tmp_path, checkpoint, capsys):
    home = tmp_path / "home"
    first = generate(home, checkpoint, capsys)
    assert generate(home, checkpoint, capsys) == first
    files = sorted((home / "store").glob("*/*.skv"))
    assert len(files) >= 8

    code, stats, _ = cache("stats", home, capsys)
    assert code == 0
    # prefix blocks, plus the whole prompt for sharing when it has share's min_tokens (tokenizer-dependent)
    kinds = Counter(str(decode(f.read_bytes()).kind) for f in files)
    assert kinds["block"] >= 8 and set(kinds) <= {"block", "prompt"}
    assert stats["entries"] == len(files) and stats["by_kind"] == dict(kinds)
    assert stats["bytes"] == sum(f.stat().st_size for f in files)
    usage = stats["usage"]
    assert usage["processes"] == 2
    disk = usage["tiers"]["disk"]
    assert disk["hits"] == len(files) and disk["writes"] == len(files)  # run 2 read every block run 1 wrote
    assert 0 < disk["hit_rate"] < 1 and 0 < usage["store"]["hit_rate"] < 1
    assert usage["tiers"]["memory"]["hit_rate"] == 0.0  # each run starts with an empty memory tier

    damaged = {files[1]: "flip", files[3]: "empty", files[5]: "garbage"}
    good = {f: f.read_bytes() for f in files if f not in damaged}
    for f, how in damaged.items():
        data = bytearray(f.read_bytes())
        if how == "flip":
            data[-7] ^= 0x10
        elif how == "empty":
            data = bytearray()
        else:
            data = bytearray(os.urandom(len(data)))
        f.write_bytes(bytes(data))
    stale = files[0].parent / f".tmp-{files[0].stem}.999999999.1"  # pid beyond pid_max: a dead writer
    stale.write_bytes(b"partial")

    code, stats, _ = cache("stats", home, capsys)
    assert code == 0 and stats["unreadable_headers"] == 2 and stats["swept_temp_files"] == 1
    assert all(f.exists() for f in damaged)  # stats removes nothing

    code, report, _ = cache("verify", home, capsys)
    assert code == 1
    assert report["checked"] == len(files) and report["damaged"] == 3 and report["ok"] == len(files) - 3
    assert {r["key"] for r in report["removed"]} == {f.stem for f in damaged}
    assert all(r["reason"] for r in report["removed"])
    assert not any(f.exists() for f in damaged)
    assert len(list((home / "store" / "quarantine").iterdir())) == 3
    assert all(f.read_bytes() == data for f, data in good.items())

    code, report, _ = cache("verify", home, capsys)
    assert code == 0 and report["damaged"] == 0 and report["checked"] == len(files) - 3

    assert generate(home, checkpoint, capsys) == first
    assert all(decode(f.read_bytes()).key == f.stem for f in damaged)  # rewritten whole
    code, report, _ = cache("verify", home, capsys)
    assert code == 0 and report["checked"] == len(files)

    code, cleared, _ = cache("clear", home, capsys)
    assert code == 0 and cleared["existed"] and not (home / "store").exists()


def test_stats_of_an_empty_home_and_a_bad_home(tmp_path, capsys):
    code, stats, _ = cache("stats", tmp_path / "fresh", capsys)
    assert code == 0 and stats["entries"] == 0 and stats["usage"]["processes"] == 0
    (tmp_path / "file-home").write_text("x")
    code, out, err = cache("verify", tmp_path / "file-home", capsys)
    assert code == 2 and "file-home" in err and "Traceback" not in err
