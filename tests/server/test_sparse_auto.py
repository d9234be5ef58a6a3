"""``sparse="auto"`` through the HTTP ``semkv`` extension and the ``semkv generate`` CLI.

Injected: requests naming ``auto`` (and a bad policy name) over HTTP; ``python -m semkv generate --sparse
auto`` on a tiny checkpoint without a profile. Must happen: auto is accepted and the response's stats say
what it resolved to (dense, no profile); a bad name is a 400; the CLI prints the same note.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server.conftest import TINY


def test_http_accepts_auto_and_reports_the_choice(client):
    body = {
        "model": TINY,
        "prompt": "The lamp is",
        "max_tokens": 2,
        "semkv": {"sparse": "auto", "kv_budget": 0.2},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert "no calibrated profile" in r.json()["semkv"]["sparse_auto"]
    bad = client.post("/v1/completions", json={**body, "semkv": {"sparse": "automatic"}})
    assert bad.status_code == 400 and "auto" in bad.text


def test_cli_generate_accepts_auto(tiny_checkpoint, tmp_path):
    cmd = [sys.executable, "-m", "semkv", "generate", "The lamp is", "--model", str(tiny_checkpoint)]
    cmd += ["--home", str(tmp_path / "home"), "--max-new-tokens", "2", "--sparse", "auto", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stderr[done.stderr.index("{") :])
    assert "no calibrated profile" in stats["sparse_auto"]
    bad = subprocess.run(cmd[:-4] + ["--sparse", "automatic"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "auto" in bad.stderr
