"""After start-up, only the engine thread runs the model.

Injected: document uploads and deletes (model and store work asked from the event loop), a job that
raises, and a start-up build that raises. Must happen: a document's KV is computed and deleted on the
engine thread ("semkv-engine"), never on the event loop's thread pool (two threads running torch
parallel regions slow every later decode step ~1.5x on 2 cores, see semkv/server/worker.py); a job's
error reaches its caller and the loop keeps serving; ``semkv serve`` builds its engine on a thread that
has ended by the time it serves, and a failed build raises on the caller.
"""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from semkv.server.command import on_a_thread_of_its_own

TINY = "tiny"


def test_documents_are_computed_and_deleted_on_the_engine_thread(tiny_app):
    app = tiny_app()
    engine = app.state.semkv.engine
    threads: dict[str, list[str]] = {"add": [], "delete": []}
    add_chunks, delete = engine.add_chunks, engine.store.delete

    def add_chunks_here(*args, **kwargs):
        threads["add"].append(threading.current_thread().name)
        return add_chunks(*args, **kwargs)

    def delete_here(*args, **kwargs):
        threads["delete"].append(threading.current_thread().name)
        return delete(*args, **kwargs)

    engine.add_chunks, engine.store.delete = add_chunks_here, delete_here
    with TestClient(app) as client:
        doc = client.post("/v1/documents", json={"input": ["A passage about engines and threads."]})
        assert doc.status_code == 200, doc.text
        doc_id = doc.json()["data"][0]["id"]
        body = {"model": TINY, "prompt": "Why?", "max_tokens": 3, "semkv": {"documents": [doc_id]}}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.delete(f"/v1/documents/{doc_id}").json()["deleted"] is True
    assert threads["add"] == ["semkv-engine"]
    assert threads["delete"] and set(threads["delete"]) == {"semkv-engine"}


def test_a_failing_job_reaches_its_caller_and_the_loop_goes_on(tiny_app):
    app = tiny_app()
    with TestClient(app) as client:
        loop = app.state.semkv.loop
        with pytest.raises(ZeroDivisionError):
            loop.run_job(lambda: 1 / 0).result(timeout=30)
        assert loop.run_job(threading.current_thread).result(timeout=30).name == "semkv-engine"
        body = {"model": TINY, "prompt": "Still there?", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
    with pytest.raises(RuntimeError, match="shut down"):
        loop.run_job(lambda: None)


def test_serve_builds_on_a_thread_that_has_ended():
    seen: list[threading.Thread] = []

    def build() -> str:
        seen.append(threading.current_thread())
        return "engine"

    assert on_a_thread_of_its_own(build) == "engine"
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()

    def fail() -> None:
        raise OSError("no model here")

    with pytest.raises(OSError, match="no model here"):
        on_a_thread_of_its_own(fail)
