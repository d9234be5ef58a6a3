"""Path traversal through the document routes, sent as an attacker sends it.

Injected (a real uvicorn server in a thread whose home holds a document, its chunk KV and a file
outside the documents folder; raw sockets, so the path is not normalised — httpx turns
``/v1/documents/../../store`` into ``/store`` and an httpx-based test never reaches the route):
GET and DELETE of ``/v1/documents/`` followed by ``..``, ``../../store``, encoded dots and slashes,
``../../../../etc/passwd``, a NUL byte, an over-long id.

Must hold: every answer is a 404 (or 400) in OpenAI's error shape, never a 200 or a 5xx; the
server's metrics count every one of them under the ``/v1/documents`` endpoint (so they reached the
document routes un-normalised); no file of the home changed or disappeared; the document is still
served to its owner.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig
from tests.server.raw_http import raw_request

TINY = "tiny"
DOC = "The harbour was built in 1820. Ships from the north bring timber and salt."
PATHS = [
    "/v1/documents/..",
    "/v1/documents/../../store",
    "/v1/documents/..%2F..%2Fstore",
    "/v1/documents/%2e%2e",
    "/v1/documents/%2e%2e%2f%2e%2e%2fstore",
    "/v1/documents/../../../../etc/passwd",
    "/v1/documents/..%5c..%5cstore",
    "/v1/documents/doc-%00",
    "/v1/documents/" + "a" * 4000,
]


def documents_requests(metrics: str) -> int:
    """Requests the server counted under the /v1/documents endpoint (any status)."""
    total = 0
    for line in metrics.splitlines():
        if re.match(r'semkv_requests_total\{endpoint="/v1/documents",', line):
            total += int(float(line.split()[-1]))
    return total


def home_files(home) -> dict:
    return {p: p.read_bytes() for p in home.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.fixture
def served(tiny_app, live_server, tmp_path):
    app = tiny_app(ServerConfig())
    state = app.state.semkv
    home = state.engine.config.home_path
    with TestClient(app) as client:  # upload through the app (the live server below serves it)
        doc = client.post("/v1/documents", json={"input": DOC}).json()["data"][0]
    (home / "secret.txt").write_text("outside the documents folder")
    return live_server(app=app), home, doc


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_traversal_paths_reach_the_route_and_get_nothing(served, method):
    base, home, doc = served
    before = home_files(home)
    counted = documents_requests(raw_request(base, "GET", "/metrics").body.decode())
    for path in PATHS:
        r = raw_request(base, method, path)
        assert r.status in (400, 404), (path, r.status, r.body[:200])
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "outside the documents" not in r.body.decode(errors="replace")
    now = documents_requests(raw_request(base, "GET", "/metrics").body.decode())
    assert now - counted == len(PATHS), "a path was normalised before it reached the server"
    assert home_files(home).keys() >= before.keys()
    assert all(
        home_files(home)[p] == data for p, data in before.items() if p.suffix in (".skv", ".json", ".txt")
    )
    r = raw_request(base, "GET", f"/v1/documents/{doc['id']}")
    assert r.status == 200 and r.json()["text"] == DOC
