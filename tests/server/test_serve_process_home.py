"""A throwaway server home (``ServeProcess(remove_home=True)``, what the benchmarks start) is deleted.

Injected: a real ``semkv serve`` subprocess over a tiny checkpoint, stopped after one request; and one
given a bad flag, so it exits on its own with an error. Must happen: the first one's home (its disk
store, share index and log) is gone after ``stop``; the crashed one's home and log stay for a look; a
server without ``remove_home`` keeps its home.
"""

from __future__ import annotations

import httpx

from semkv.server.process import ServeProcess
from tests.server.conftest import TINY


def test_a_stopped_throwaway_server_leaves_no_home(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    server = ServeProcess(
        tiny_checkpoint, home, "--served-model-name", TINY, "--threads", "1", remove_home=True
    )
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=60) as client:
            body = {"model": TINY, "prompt": "Ships were counted.", "max_tokens": 2}
            assert client.post("/v1/completions", json=body).status_code == 200
        assert (home / "store").is_dir()
    finally:
        server.stop()
    assert not home.exists()


def test_a_crashed_server_keeps_its_home_and_log(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    server = ServeProcess(tiny_checkpoint, home, "--no-such-flag", remove_home=True)
    assert server.proc.wait(timeout=60) != 0
    server.stop()
    assert (home / "serve.log").is_file() and "no-such-flag" in (home / "serve.log").read_text()


def test_a_server_keeps_its_home_by_default(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    server = ServeProcess(tiny_checkpoint, home, "--served-model-name", TINY, "--threads", "1")
    try:
        server.wait_ready()
    finally:
        server.stop()
    assert (home / "serve.log").is_file()
