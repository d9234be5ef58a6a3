"""Bad input through the ``semkv`` command line is a one-line error and exit code 2, never a traceback.

Injected: 17 bad invocations of ``semkv generate`` — an empty prompt, a prompt of non-UTF-8 bytes
(in-process as surrogate-escaped text and through a real subprocess with raw argv bytes), absurd and
non-integer --max-new-tokens, an unknown --reuse, a NaN temperature, a missing / non-UTF-8 / directory
--chunk-file, --block-size 0, an unsupported-architecture --model folder, a missing --model path, a
--home that is a file, an over-length prompt — against a tiny checkpoint folder with a populated store.

Must happen: exit code 2, stderr names the problem (the field, file or folder) and holds no
traceback, the store on disk is byte-for-byte unchanged, and a good invocation afterwards succeeds
and reuses the stored prefix.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.reliability.reliability_helpers import run_cli, save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", tokenizer)


def _store_prompt(checkpoint, home, capsys) -> tuple[int, str, str]:
    """`semkv generate` of one short prompt (block size 4), so its blocks land in ``home``'s store."""
    return run_cli(
        [
            "generate",
            "A prompt to store.",
            "--model",
            str(checkpoint),
            "--home",
            str(home),
            "--max-new-tokens",
            "2",
            "--block-size",
            "4",
        ],
        capsys,
    )


@pytest.fixture
def home(tmp_path, checkpoint, capsys):
    home = tmp_path / "home"
    code, _, _ = _store_prompt(checkpoint, home, capsys)
    assert code == 0
    return home


def snapshot(home):
    return {p: p.read_bytes() for p in (home / "store").rglob("*.skv")}


def bad_cases(tmp_path, checkpoint):
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes("caf\xe9 au lait".encode("latin-1"))
    gpt2 = tmp_path / "gpt2-model"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    m = ["--model", str(checkpoint)]
    return [
        (["generate", "", *m], "empty"),
        (["generate", "   ", *m], "empty"),
        (["generate", "caf\udce9", *m], "not valid Unicode"),
        (["generate", "hi", "--max-new-tokens", "0", *m], "max_new_tokens"),
        (["generate", "hi", "--max-new-tokens", "99999999999", *m], "max_new_tokens"),
        (["generate", "hi", "--max-new-tokens", "lots", *m], "--max-new-tokens"),
        (["generate", "hi", "--reuse", "bogus", *m], "reuse mode"),
        (["generate", "hi", "--temperature", "nan", *m], "temperature"),
        (["generate", "hi", "--chunk-file", str(tmp_path / "missing.txt"), *m], "missing.txt"),
        (["generate", "hi", "--chunk-file", str(not_utf8), *m], "latin1.txt is not UTF-8"),
        (["generate", "hi", "--chunk-file", str(tmp_path), *m], str(tmp_path)),
        (["generate", "hi", "--block-size", "0", *m], "block_size"),
        (["generate", "hi", "--model", str(gpt2)], "unsupported model architecture 'gpt2'"),
        (["generate", "hi", "--model", str(tmp_path / "nowhere")], "nowhere"),
        (["generate", "word " * 2100, "--max-new-tokens", "4", *m], "context"),
    ]


def test_bad_invocations_exit_2_with_a_clear_message(tmp_path, checkpoint, home, capsys):
    before = snapshot(home)
    cases = bad_cases(tmp_path, checkpoint)
    for argv, needle in cases:
        block_size = [] if "--block-size" in argv else ["--block-size", "4"]  # the store's block size
        code, out, err = run_cli([*argv, "--home", str(home), *block_size], capsys)
        assert code == 2, (argv[:3], code, err)
        assert needle.lower() in err.lower(), (argv[:3], err)
        assert "Traceback" not in err and out == ""
        assert snapshot(home) == before
    code, out, err = _store_prompt(checkpoint, home, capsys)
    assert code == 0 and int(re.search(r'"reused_tokens": (\d+)', err).group(1)) > 0


def test_home_that_is_a_file(tmp_path, checkpoint, capsys):
    home = tmp_path / "home-file"
    home.write_text("not a folder")
    code, out, err = run_cli(["generate", "hi", "--model", str(checkpoint), "--home", str(home)], capsys)
    assert code == 2 and str(home) in err and "Traceback" not in err
    assert home.read_text() == "not a folder"


def test_raw_non_utf8_argv_through_the_real_command(tmp_path, checkpoint):
    env = dict(os.environ, SEMKV_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-m", "semkv.cli", "generate", b"caf\xe9", "--model", str(checkpoint)],
        capture_output=True,
        env=env,
        timeout=300,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2, err
    assert "not valid Unicode" in err and "Traceback" not in err
