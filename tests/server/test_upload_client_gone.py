"""Failure mode: a client uploads 64 documents and disconnects before the upload is done.

Injected: a real socket sends ``POST /v1/documents`` with 64 distinct long documents to a uvicorn server
(tiny engine) and closes once the engine has computed 2 of them; the engine's ``add_chunks`` is wrapped to record what it computes
(it still computes it) and to take at least ``SLOW_DOCUMENT_S`` per document, so that the 64 documents
outlast the disconnect on any CPU. Must happen: the server notices the client is gone between documents and computes
no more of them (at most those started before the disconnect was seen, never all 64); none is registered;
a request right after is served. On the old code the upload was one engine job that computed all 64
documents and registered them after the client had left.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx

from tests.server.conftest import TINY

DOCUMENTS = 64
LEAVE_AFTER = 2  # documents computed before the client leaves
DISCONNECT_SEEN_S = 1.0  # polls of the server (0.25 s) + one document's compute, with a margin for a busy CPU
SLOW_DOCUMENT_S = 0.1  # injected compute time per document: 64 of them take >= 6.4 s


def document(i: int) -> str:
    return " ".join(
        f"Record {i}.{j}: the harbour master logged boat {i * 31 + j} at berth {j % 17}." for j in range(80)
    )


def send_and_leave(base: str, body: bytes, leave: threading.Event) -> float:
    """POST ``body`` to /v1/documents on a raw socket and close it once ``leave`` is set (at most 60 s);
    returns when it closed."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port)) as sock:
        head = (
            f"POST /v1/documents HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        leave.wait(60)
    return time.perf_counter()


def test_an_upload_stops_when_its_client_leaves(live_server, tiny_app):
    app = tiny_app()
    engine = app.state.semkv.engine
    computed: list[tuple[float, float, int]] = []  # (start, end, documents) of each add_chunks call
    real = engine.add_chunks
    leave = threading.Event()

    def recorded(texts, *args, **kwargs):
        start = time.perf_counter()
        time.sleep(SLOW_DOCUMENT_S * len(texts))
        keys = real(texts, *args, **kwargs)
        computed.append((start, time.perf_counter(), len(texts)))
        if sum(n for _, _, n in computed) >= LEAVE_AFTER:
            leave.set()
        return keys

    engine.add_chunks = recorded
    base = live_server(app=app)
    body = json.dumps({"input": [document(i) for i in range(DOCUMENTS)]}).encode()

    closed = send_and_leave(base, body, leave)
    time.sleep(DISCONNECT_SEEN_S + 0.5)
    # the engine thread runs jobs before steps: once this is answered, no document is being computed
    probe = httpx.post(
        f"{base}/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 1}, timeout=60
    )

    assert probe.status_code == 200
    per_document = min((end - start) / n for start, end, n in computed)
    assert per_document * DOCUMENTS > 1.5 * DISCONNECT_SEEN_S, "documents too short to tell"
    done = sum(n for _, _, n in computed)
    assert 0 < done < DOCUMENTS
    assert not [start for start, _, _ in computed if start > closed + DISCONNECT_SEEN_S]
    assert httpx.get(f"{base}/v1/documents").json()["data"] == []  # nothing registered
