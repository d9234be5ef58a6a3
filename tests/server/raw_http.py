"""HTTP/1.1 over a raw socket: the request line and body bytes exactly as given.

httpx (and so TestClient) normalises paths (``/v1/documents/../../store`` becomes ``/store``) and
always frames bodies itself; an attack test must send what an attacker sends.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def _read_response(sock: socket.socket) -> RawResponse:
    data = b""
    while True:
        try:
            part = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not part:
            break
        data += part
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return RawResponse(status, headers, body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


def raw_request(
    base_url: str,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    chunks: list[bytes] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> RawResponse:
    """Send one request (``Connection: close``); ``chunks``: send the body with chunked transfer
    encoding, one HTTP chunk each (no Content-Length). A server that answers early and closes
    is fine: the rest of the body is dropped and the answer read."""
    url = urlsplit(base_url)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {url.hostname}:{url.port}", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if chunks is not None:
        lines.append("Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c) + b"0\r\n\r\n"
    else:
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}")
        payload = body
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as sock:
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            for start in range(0, len(payload), 16384):
                sock.sendall(payload[start : start + 16384])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered before reading everything (a 413) and closed
        return _read_response(sock)
