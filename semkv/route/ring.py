"""Which backend should serve a request: a consistent-hash ring over backends, and the request's affinity key.

The affinity key names what the backend that served the request before now holds in its fast tiers:

* a request naming documents (``semkv.documents``): the first document id — its chunk KV, and the
  first blocks of the prompt it opens;
* inline context (``semkv.chunks``): the first ``prefix_chars`` characters of the first chunk;
* otherwise the first ``prefix_chars`` characters of the prompt (chat: of the messages, role by role) —
  the text of the first prefix blocks, whose chained keys every longer prompt with that start shares;
* a document upload: the id of its first document (so later requests naming it come to the same backend);
  ``GET /v1/documents/{id}``: that id.

Only the request body is read (no tokenizer, no server internals): the router works with any
OpenAI-compatible backend, and requests it cannot read are routed by load alone.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from typing import Any

AFFINITY_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/documents")


def point(text: str) -> int:
    """A 64-bit ring position (sha256; never Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")


class HashRing:
    """Consistent hashing: every node owns ``vnodes`` points; a key goes to the first node clockwise.

    Adding or removing one node moves only the keys that node gains or loses (about 1/N of them).
    """

    def __init__(self, nodes: Sequence[str], vnodes: int = 256) -> None:
        if not nodes:
            raise ValueError("a hash ring needs at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"ring nodes must be unique, got {list(nodes)}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.nodes = list(nodes)
        ring = sorted((point(f"{node}#{i}"), node) for node in nodes for i in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]

    def order(self, key: str) -> list[str]:
        """Every node, in the order the ring offers them for ``key`` (the owner first)."""
        start = bisect.bisect(self._points, point(key))
        seen: list[str] = []
        for i in range(len(self._owners)):
            node = self._owners[(start + i) % len(self._owners)]
            if node not in seen:
                seen.append(node)
                if len(seen) == len(self.nodes):
                    break
        return seen


def document_id(text: str) -> str:
    """The id a semkv server gives a document: ``doc-`` + the first 32 hex digits of its text's sha256
    (part of the API: ids are content addresses, the same on every server)."""
    return "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _first_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return None


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n"


def _leading_text(path: str, body: dict[str, Any], prefix_chars: int) -> str | None:
    if path == "/v1/completions":
        prompt = _first_str(body.get("prompt"))
        return None if prompt is None else prompt[:prefix_chars]
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    text = ""
    for message in messages:
        text += _message_text(message)
        if len(text) >= prefix_chars:
            break
    return text[:prefix_chars] or None


def affinity_key(method: str, path: str, body: bytes, prefix_chars: int = 256) -> str | None:
    """The key a request is hashed on (see the module doc); None: route by load alone."""
    if method == "GET" and path.startswith("/v1/documents/"):
        return "doc:" + path.rsplit("/", 1)[1]
    if method != "POST" or path not in AFFINITY_PATHS:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if path == "/v1/documents":
        first = _first_str(data.get("input"))
        return None if first is None else "doc:" + document_id(first)
    ext = data.get("semkv")
    if isinstance(ext, dict):
        doc = _first_str(ext.get("documents"))
        if doc is not None:
            return "doc:" + doc
        chunk = _first_str(ext.get("chunks"))
        if chunk is not None:
            return "text:" + chunk[:prefix_chars]
    text = _leading_text(path, data, prefix_chars)
    return None if text is None else "text:" + text
