"""The document registry: a document id names a text whose chunk KV is (or will be) in the store.

Ids are content addresses (``doc-`` + sha256 of the text), so the same text gets the
same id on every server. Records live in process memory, in ``<home>/documents`` (they
survive a restart, like the disk store) and, when the store has a Redis tier, in Redis
under ``<namespace>:doc:{<id>}`` — so a document uploaded to one server can be named in a
request to another server sharing that Redis. The KV itself is never here: it is in
the store under chunk keys, found again from the text's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from semkv.store.redis_tier import RedisTier

log = logging.getLogger(__name__)


def document_id(text: str) -> str:
    return "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def is_document_id(value: str) -> bool:
    return (
        isinstance(value, str)
        and len(value) == 36
        and value.startswith("doc-")
        and all(c in "0123456789abcdef" for c in value[4:])
    )


@dataclass
class Document:
    """id: content address; tokens: token count of the text as one chunk;
    chunk_ids: store keys of its precomputed chunk KV (empty if not precomputed)."""

    id: str
    text: str
    tokens: int
    chunk_ids: list[str] = field(default_factory=list)
    created: int = 0

    def __post_init__(self) -> None:
        if not is_document_id(self.id) or self.id != document_id(self.text):
            raise ValueError(f"document id {self.id!r} does not match its text")
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")

    @property
    def precomputed(self) -> bool:
        return bool(self.chunk_ids)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> Document:
        raw: dict[str, Any] = json.loads(data)
        return cls(
            id=str(raw["id"]),
            text=str(raw["text"]),
            tokens=int(raw["tokens"]),
            chunk_ids=[str(c) for c in raw.get("chunk_ids", [])],
            created=int(raw.get("created", 0)),
        )

    def summary(self) -> dict[str, Any]:
        """The API view (no text)."""
        return {
            "id": self.id,
            "object": "document",
            "created": self.created,
            "tokens": self.tokens,
            "chunk_ids": self.chunk_ids,
            "precomputed": self.precomputed,
        }


class DocumentRegistry:
    """Memory -> disk folder -> Redis, read-through; writes go to all. Thread-safe."""

    def __init__(self, folder: Path | None = None, redis: RedisTier | None = None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.redis = redis
        self._docs: dict[str, Document] = {}
        self._lock = threading.Lock()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, doc_id: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{doc_id}.json"

    def put(self, doc: Document) -> None:
        with self._lock:
            self._docs[doc.id] = doc
        data = doc.to_json()
        if self.folder is not None:
            tmp = self.folder / f".tmp-{doc.id}.{os.getpid()}.{threading.get_ident()}"
            try:
                tmp.write_text(data)
                os.replace(tmp, self._path(doc.id))
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                log.warning("cannot write document record %s: %s", doc.id, exc)
        if self.redis is not None:
            self.redis.put_record("doc", doc.id, data)

    def get(self, doc_id: str) -> Document | None:
        if not is_document_id(doc_id):
            return None
        with self._lock:
            doc = self._docs.get(doc_id)
        if doc is not None:
            return doc
        doc = self._load_local(doc_id)
        if doc is None and self.redis is not None:
            doc = self._load_redis(doc_id)
        if doc is not None:
            with self._lock:
                self._docs[doc.id] = doc
        return doc

    def _load_local(self, doc_id: str) -> Document | None:
        if self.folder is None:
            return None
        try:
            return Document.from_json(self._path(doc_id).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable document record %s: %s", doc_id, exc)
            return None

    def _load_redis(self, doc_id: str) -> Document | None:
        assert self.redis is not None
        data = self.redis.get_record("doc", doc_id)
        if data is None:
            return None
        try:
            return Document.from_json(data)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable document record %s in Redis: %s", doc_id, exc)
            return None

    def list(self) -> list[Document]:
        """Documents known to this process (memory and disk folder)."""
        if self.folder is not None:
            for path in self.folder.glob("doc-*.json"):
                self.get(path.stem)
        with self._lock:
            return sorted(self._docs.values(), key=lambda d: (d.created, d.id))

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)

    @staticmethod
    def new(text: str, tokens: int, chunk_ids: list[str]) -> Document:
        return Document(document_id(text), text, tokens, list(chunk_ids), int(time.time()))
