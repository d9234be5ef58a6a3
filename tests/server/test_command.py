"""``semkv serve`` options: ``--default KEY=VALUE`` (server-wide engine defaults) and ``--kv-dtype``.

Injected: a real ``semkv serve`` subprocess over a tiny checkpoint with ``--default reuse=none
--default recompute_ratio=0.5 --kv-dtype float32``; bad defaults in-process.
Must happen: ``--default`` values are parsed as JSON where they parse (else strings) and apply to every
request unless its ``semkv`` field overrides them; the KV the server stores is float32; a bad default
is a one-line error (exit 2) before any model loads.
"""

from __future__ import annotations

import httpx
import torch

from semkv.cli import build_parser
from semkv.store.entry import decode
from tests.reliability.reliability_helpers import run_cli

TINY = "tiny"
PROMPT = "A long shared system prompt about the harbour, the boats and the fishermen at dawn. " * 2
DOC = "The lighthouse keeper of the island counted ships every night and wrote their names in a blue book."


def test_default_values_are_parsed_as_json_or_strings():
    args = build_parser().parse_args(
        ["serve", "--default", "reuse=auto", "--default", "recompute_ratio=0.2"]
        + ["--default", 'blend={"gradual": true}', "--default", "store_prompt=false"]
    )
    assert args.default == [
        ("reuse", "auto"),
        ("recompute_ratio", 0.2),
        ("blend", {"gradual": True}),
        ("store_prompt", False),
    ]
    assert build_parser().parse_args(["serve", "--kv-dtype", "float32"]).kv_dtype == "float32"


def test_bad_default_is_a_clear_error(tmp_path, capsys):
    for bad, message in (("reuse=bogus", "unknown reuse mode 'bogus'"), ("max_new_tokens=3", "cannot set")):
        code, _, err = run_cli(["serve", "--model", str(tmp_path / "none"), "--default", bad], capsys)
        assert code == 2 and message in err and "Traceback" not in err


def test_serve_defaults_and_kv_dtype(tiny_checkpoint, serve_process, tmp_path):
    home = tmp_path / "home"
    server = serve_process(
        tiny_checkpoint, home, "--default", "reuse=none", "--default", "recompute_ratio=0.5",
        "--kv-dtype", "float32", "--block-size", "4",
    )  # fmt: skip
    server.wait_ready()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        request = {"model": TINY, "prompt": PROMPT, "max_tokens": 2}
        assert c.post("/v1/completions", json=request).status_code == 200
        again = c.post("/v1/completions", json=request).json()["semkv"]
        assert again["path"] == "full" and again["reused_tokens"] == 0  # reuse=none for every request
        own = c.post("/v1/completions", json={**request, "semkv": {"reuse": "prefix"}}).json()["semkv"]
        assert own["path"] == "prefix" and own["reused_tokens"] > 0  # a request's own setting wins

        doc = c.post("/v1/documents", json={"input": [DOC]}).json()["data"][0]
        blended = c.post(
            "/v1/completions",
            json={"model": TINY, "prompt": "Who counted ships?", "max_tokens": 2,
                  "semkv": {"documents": [doc["id"]], "reuse": "blend"}},
        ).json()["semkv"]  # fmt: skip
        assert blended["path"] == "blend" and blended["recompute_ratio"] == 0.5  # the server default

    stored = [decode(p.read_bytes()) for p in (home / "store").glob("*/*.skv")]
    assert stored and all(e.k.dtype == torch.float32 and e.v.dtype == torch.float32 for e in stored)
