"""``semkv serve`` restarts itself with ``MALLOC_ARENA_MAX=1`` (``semkv.host_memory.restart_with_one_arena``).

Injected: a real ``semkv serve`` subprocess over a tiny checkpoint, started from an environment without
the variable; then one started with ``--no-keep-freed-memory``. Must happen: the first process (same pid:
the restart replaces it) serves with ``MALLOC_ARENA_MAX=1`` and glibc's per-thread cache off
(``GLIBC_TUNABLES``) in its environment, so its engine thread allocates from glibc's main arena and keeps
the memory it frees; the second is left as started.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from semkv.host_memory import ARENA_ENV, NO_TCACHE, TUNABLES_ENV
from semkv.server.process import ServeProcess
from tests.server.conftest import TINY
from tests.test_host_memory import glibc_only


def environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.fixture
def no_arena_variable(monkeypatch):
    monkeypatch.delenv(ARENA_ENV, raising=False)
    monkeypatch.delenv(TUNABLES_ENV, raising=False)


@glibc_only
@pytest.mark.parametrize("keep", [True, False], ids=["default", "no-keep-freed-memory"])
def test_serve_runs_with_one_arena_unless_told_not_to(keep, no_arena_variable, tiny_checkpoint, tmp_path):
    flags = [] if keep else ["--no-keep-freed-memory"]
    server = ServeProcess(
        tiny_checkpoint, tmp_path / "home", "--served-model-name", TINY, "--threads", "1", *flags
    )
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"model": TINY, "prompt": "Ships were counted.", "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
        environment = environment_of(server.proc.pid)
        assert environment.get(ARENA_ENV) == ("1" if keep else None)
        assert environment.get(TUNABLES_ENV) == (NO_TCACHE if keep else None)
    finally:
        server.stop()
