"""What is stored after the first token (prefix blocks, chunks, the prompt for sharing) never fails the
request it comes from.

Injected (a server over a tiny engine, prompts over the share path's 64 tokens): (1) the share path's
post-prefill hook raises; (2) the share index journal's fsync fails with ENOSPC (only that file: the
KV entries are still written).

Must hold: every request is answered 200 with the same text as a cache-less run; the failure is
logged and counted in ``/metrics`` (``semkv_background_failures_total{what=...}``); the other hooks
still ran (the prompt's prefix blocks are stored and reused by the next request); after the journal
works again the remembered prompt reaches the disk.
"""

from __future__ import annotations

import errno
import os

import pytest
from fastapi.testclient import TestClient

import semkv.reuse.lsh as lsh_module

TINY = "tiny"
LONG = "The museum guide explains the paintings of the east wing, one room after the other. " * 3


def failures(client, what: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'semkv_background_failures_total{{what="{what}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def served(tiny_app):
    app = tiny_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app.state.semkv.engine, client


def ask(client, prompt: str, **semkv) -> dict:
    r = client.post(
        "/v1/completions", json={"model": TINY, "prompt": prompt, "max_tokens": 3, "semkv": semkv}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_raising_hook_is_counted_and_the_request_served(served, monkeypatch, caplog):
    engine, client = served
    reference = ask(client, LONG + " Reference.", reuse="none", store_prompt=False)["choices"][0]["text"]

    def broken(*args, **kwargs):
        raise RuntimeError("share index exploded")

    monkeypatch.setattr(engine.paths["share"], "after_prefill", broken)
    first = ask(client, LONG + " Reference.")
    assert first["choices"][0]["text"] == reference
    assert failures(client, "after_prefill_share") == 1.0
    assert "share index exploded" in caplog.text
    second = ask(client, LONG + " Reference.")
    assert second["semkv"]["reused_tokens"] > 0  # the prefix hook ran despite the share hook's failure


def test_journal_enospc_is_counted_and_retried(served, monkeypatch):
    engine, client = served
    real_fsync = os.fsync

    def journal_full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(lsh_module.os, "fsync", journal_full)
    ask(client, LONG)
    assert failures(client, "share_index_writes") >= 1
    assert len(engine.paths["share"].index) == 1  # remembered in memory
    monkeypatch.setattr(lsh_module.os, "fsync", real_fsync)
    ask(client, LONG + " Another prompt, journaled with the one kept to retry.")
    reopened = lsh_module.PromptIndex(engine.paths["share"].index_config, engine.share_index_folder())
    assert len(reopened) == 2  # the record kept in memory was journaled with the next one
