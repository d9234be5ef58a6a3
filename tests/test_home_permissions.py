"""The semkv home holds other people's prompts (as KV, token ids and documents): only its user reads it.

Injected: an engine on a home that does not exist yet serves a long prompt (stored as prefix blocks
and as a shared prompt, which journals the share index), a document is uploaded through the server,
the engine is closed (writing the usage record); then an engine opens a home that exists with mode 0755.

Must hold: the new home is created 0700; no file the engine or the server wrote is readable or
writable by group or others (entries, share index journal, document records, usage record); the
existing open home is reported with a warning (it is left as it is: it may be shared on purpose).
"""

from __future__ import annotations

import logging
import stat

from fastapi.testclient import TestClient

from semkv.server import create_app
from tests.reliability.reliability_helpers import engine_at

LONG = "The harbour master records every ship, its cargo and its crew in the harbour book. " * 4


def test_home_and_files_are_private(tmp_path, tokenizer):
    home = tmp_path / "new" / "home"
    engine = engine_at(home, tokenizer)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    engine.generate(LONG, max_new_tokens=1)
    engine.name = "tiny"
    with TestClient(create_app(engine)) as client:
        assert client.post("/v1/documents", json={"input": "A private document."}).status_code == 200
    engine.close()
    files = [p for p in home.rglob("*") if p.is_file() and "models" not in p.parts]
    kinds = {p.suffix for p in files}
    assert {".skv", ".jsonl", ".json"} <= kinds, kinds
    open_to_others = [
        (str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in files if p.stat().st_mode & 0o077
    ]
    assert not open_to_others, open_to_others
    folders = [p for p in home.rglob("*") if p.is_dir() and "models" not in p.parts]
    assert all(not (p.stat().st_mode & 0o077) for p in folders), [
        (str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in folders if p.stat().st_mode & 0o077
    ]


def test_an_open_existing_home_is_reported(tmp_path, tokenizer, caplog):
    home = tmp_path / "shared-home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    caplog.set_level(logging.WARNING)
    engine_at(home, tokenizer)
    assert any("open to other users" in r.getMessage() for r in caplog.records)
    assert stat.S_IMODE(home.stat().st_mode) == 0o755
