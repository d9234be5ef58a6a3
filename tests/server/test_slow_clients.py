"""Failure mode: slow clients (slowloris) — request headers sent a byte at a time, a body that stalls.

Injected: real sockets to a uvicorn server run as ``semkv serve`` runs it (the header-timeout protocol of
:mod:`semkv.server.http`, 1 s here; ``body_timeout_s`` 1 s): 5 connections send a request line and then one
header byte every 0.2 s, never finishing; one connection sends whole headers and 10 of its 100 body bytes,
then stalls. Control: the same slow headers to uvicorn's plain protocol. Must happen: each slow-header
connection is closed by the server within the timeout plus a margin (the plain protocol keeps it open
past that); the stalled body gets a 408 in OpenAI's shape; a normal request is served meanwhile.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from semkv.server import ServerConfig
from semkv.server.http import header_timeout_protocol
from tests.server.conftest import TINY

TIMEOUT_S = 1.0
MARGIN_S = 1.5  # the event loop's timer granularity and a busy CPU
SLOW_CONNECTIONS = 5


@pytest.fixture
def serve(tiny_app):
    """serve(http=None) -> (host, port) of a uvicorn server in a thread over a tiny app (body timeout 1 s)."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(http: type | str = "h11") -> tuple[str, int]:
        app = tiny_app(ServerConfig(body_timeout_s=TIMEOUT_S))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", http=http))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        servers.append((server, thread))
        return "127.0.0.1", server.servers[0].sockets[0].getsockname()[1]

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


def slow_headers(address: tuple[str, int], give_up_s: float) -> float | None:
    """Send a request's headers a byte every 0.2 s; the seconds until the server closed the connection,
    or None if it was still open after ``give_up_s``."""
    start = time.perf_counter()
    with socket.create_connection(address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.2)
        while time.perf_counter() - start < give_up_s:
            try:
                if sock.recv(1024) == b"":
                    return time.perf_counter() - start
            except TimeoutError:
                pass
            except ConnectionResetError:
                return time.perf_counter() - start
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                return time.perf_counter() - start
    return None


def in_threads(count: int, work) -> list:
    results: list = [None] * count

    def run(i: int) -> None:
        results[i] = work()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_slow_headers_are_cut_off(serve):
    address = serve(header_timeout_protocol(TIMEOUT_S))
    closed = in_threads(SLOW_CONNECTIONS, lambda: slow_headers(address, TIMEOUT_S + MARGIN_S + 2))
    assert all(t is not None and t <= TIMEOUT_S + MARGIN_S for t in closed), closed
    r = httpx.post(
        f"http://{address[0]}:{address[1]}/v1/completions",
        json={"model": TINY, "prompt": "Hi", "max_tokens": 1},
    )
    assert r.status_code == 200


def test_the_plain_protocol_keeps_slow_headers_open(serve):
    """The control: without the header timer the same connection is still open well past the timeout."""
    address = serve("h11")
    assert slow_headers(address, TIMEOUT_S + MARGIN_S + 0.5) is None


def test_a_stalled_body_is_a_408(serve):
    host, port = serve(header_timeout_protocol(TIMEOUT_S))
    with socket.create_connection((host, port)) as sock:
        start = time.perf_counter()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": "'
        )
        sock.settimeout(TIMEOUT_S + MARGIN_S + 5)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            data += part
        took = time.perf_counter() - start
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert json.loads(body)["error"]["code"] == "timeout"
    assert took <= TIMEOUT_S + MARGIN_S
