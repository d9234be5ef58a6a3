"""Every request has a deadline (``request_timeout_s`` from its arrival), whatever holds the engine.

Injected (a real uvicorn server in a thread, deadline 0.25 s): a completion asking for 2000 tokens
without stopping at EOS (the tiny model takes 0.5 to 4 ms a token, so 1 to 8 s: several deadlines
however fast or loaded the machine is), streamed and not; then a completion sent while a document
upload holds the engine for a second (its document's precompute made to take 1 s, as a long document
on a real model does: an upload computes one document per engine job, so only that job holds it;
an upload whose own deadline passed before it reached the engine, as on a loaded machine, is sent again).

Must hold: the long generation ends at its deadline — answered within 2.5 s with a 504
``deadline_exceeded`` (streamed: an SSE error event, then ``[DONE]``); the completion that arrived
during the upload, whose deadline passed before it could start, is a 504 ``deadline_exceeded`` and never
runs; the upload itself, past its own deadline, is a 504 too; the server then serves a short request
normally. (That the deadline counts from arrival, time
spent before the request reached the scheduler included, is checked in tests/test_scheduler.py.)
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import semkv.engine
from semkv.server import ServerConfig

TINY = "tiny"
PRECOMPUTE_S = 1.0
UPLOAD_ATTEMPTS = 5  # uploads whose deadline passed before they reached the engine are sent again
LONG = {"model": TINY, "prompt": "Count on:", "max_tokens": 2000, "semkv": {"stop_at_eos": False}}


@pytest.fixture
def server(live_server):
    return live_server(ServerConfig(request_timeout_s=0.25, debug_stats=True))


def test_long_generation_ends_at_its_deadline(server):
    start = time.perf_counter()
    r = httpx.post(f"{server}/v1/completions", json=LONG, timeout=30)
    assert time.perf_counter() - start < 2.5
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "deadline_exceeded"
    start = time.perf_counter()
    with httpx.stream("POST", f"{server}/v1/completions", json={**LONG, "stream": True}, timeout=30) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert time.perf_counter() - start < 2.5
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
    short = httpx.post(f"{server}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2})
    assert short.status_code == 200


def test_request_queued_past_its_deadline_is_a_504(tiny_app, live_server, monkeypatch):
    app = tiny_app(ServerConfig(request_timeout_s=0.25, debug_stats=True))
    uploading = threading.Event()
    precompute = semkv.engine.add_chunks

    uploaded = threading.Event()

    def signalling_precompute(*args, **kwargs):
        # called by Engine.add_chunks with the engine's lock held: from here on the engine is busy (a
        # signal before the lock, e.g. while the documents are tokenized, lets a request slip in first)
        uploading.set()
        time.sleep(PRECOMPUTE_S)
        try:
            return precompute(*args, **kwargs)
        finally:
            uploaded.set()

    monkeypatch.setattr(semkv.engine, "add_chunks", signalling_precompute)
    server = live_server(app=app)
    docs = ["Document: " + "the harbour master logs every ship and its cargo. " * 150]
    upload: dict = {}

    def run_upload() -> None:
        upload["response"] = httpx.post(f"{server}/v1/documents", json={"input": docs}, timeout=120)

    for _attempt in range(UPLOAD_ATTEMPTS):
        thread = threading.Thread(target=run_upload)
        thread.start()
        while not uploading.wait(0.05) and thread.is_alive():
            pass
        if uploading.is_set():  # the upload has reached the engine and holds it
            break
        thread.join()  # on a loaded machine its 0.25 s can pass before it reaches the engine: send it again
    assert uploading.is_set(), upload["response"].text
    queued = httpx.post(
        f"{server}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    thread.join(120)
    assert upload["response"].status_code == 504
    assert upload["response"].json()["error"]["code"] == "deadline_exceeded"
    assert queued.status_code == 504, queued.text
    assert queued.json()["error"]["code"] == "deadline_exceeded"
    metrics = httpx.get(f"{server}/metrics").text
    assert "semkv_prompt_tokens_total 0.0" in metrics  # the queued request never ran
    # the server then serves normally: once the upload's engine job is over (it runs on past the upload's
    # 504), a short request within its 0.25 s; a few tries, as a loaded machine's first request of a new
    # engine can take longer than that (a broken server answers none of them)
    assert uploaded.wait(60)
    codes = []
    for _ in range(3):
        codes.append(
            httpx.post(
                f"{server}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 2}
            ).status_code
        )
        if codes[-1] == 200:
            break
    assert codes[-1] == 200, codes
