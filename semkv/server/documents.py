"""The document registry: a document id names a text whose chunk KV is (or will be) in the store.

Ids are content addresses (``doc-`` + sha256 of the text), so the same text gets the same id on
every server. Records are kept per **namespace** (:class:`semkv.store.keys.Namespace`: tenant +
cache salt): a request sees the documents of its own namespace and those published to the shared
namespace, never another tenant's (not even whether they exist). Records live in process memory,
in ``<home>/documents`` (the default namespace; others in ``<home>/documents/ns-<digest>``; they
survive a restart, like the disk store) and, when the store has a Redis tier, in Redis under
``<namespace>:doc:{<ident>}`` — so a document uploaded to one server can be named in a request to
another server sharing that Redis. The KV itself is never here: it is in the store under chunk
keys, found again from the text's tokens.

With a store secret, every record carries an HMAC over its content and its namespace; a record
without a valid one (written to Redis or the folder by someone without the secret, or moved from
another namespace) is ignored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from semkv.config import private_mkdir
from semkv.store.keys import Namespace
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
    chunk_ids: store keys of its precomputed chunk KV (empty if not precomputed);
    shared: published to every tenant; owner: the tenant that uploaded it."""

    id: str
    text: str
    tokens: int
    chunk_ids: list[str] = field(default_factory=list)
    created: int = 0
    shared: bool = False
    owner: str = ""

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
            shared=bool(raw.get("shared", False)),
            owner=str(raw.get("owner", "")),
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
            "shared": self.shared,
        }


RECORD_HMAC = "hmac"


class DocumentRegistry:
    """Memory -> disk folder -> Redis, read-through; writes go to all. Thread-safe.

    secret: the store secret (bytes); records are signed with it and unsigned records are ignored.
    """

    def __init__(
        self, folder: Path | None = None, redis: RedisTier | None = None, secret: bytes | None = None
    ) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.redis = redis
        self.secret = secret
        self.write_errors = 0
        self._docs: dict[tuple[str, str], Document] = {}
        self._usage: dict[tuple[str, str], tuple[str, int]] = {}  # (folder, id) -> (owner, tokens)
        self._lock = threading.Lock()
        if self.folder is not None:
            private_mkdir(self.folder)

    # -- where records live --------------------------------------------------------------------------
    @staticmethod
    def _scope(namespace: Namespace) -> str:
        return namespace.scope or ""

    def _dir(self, namespace: Namespace) -> Path:
        assert self.folder is not None
        name = namespace.folder_name
        return self.folder / name if name else self.folder

    def _path(self, namespace: Namespace, doc_id: str) -> Path:
        return self._dir(namespace) / f"{doc_id}.json"

    @staticmethod
    def _redis_ident(namespace: Namespace, doc_id: str) -> str:
        """The record's Redis ident: the id, after the namespace's folder name outside the default."""
        name = namespace.folder_name
        return f"{name}.{doc_id}" if name else doc_id

    # -- signed records ------------------------------------------------------------------------------
    def _signature(self, body: dict[str, Any], namespace: Namespace) -> str:
        assert self.secret is not None
        message = json.dumps({"namespace": self._scope(namespace), "record": body}, sort_keys=True)
        return hmac.new(self.secret, message.encode(), hashlib.sha256).hexdigest()

    def _encode(self, doc: Document, namespace: Namespace) -> str:
        body = asdict(doc)
        if self.secret is not None:
            body[RECORD_HMAC] = self._signature(asdict(doc), namespace)
        return json.dumps(body, sort_keys=True)

    def _decode(self, data: str | bytes, namespace: Namespace) -> Document:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("a document record must be a JSON object")
        signature = raw.pop(RECORD_HMAC, None)
        doc = Document.from_json(json.dumps(raw))
        if self.secret is not None:
            expected = self._signature(asdict(doc), namespace)
            if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
                raise ValueError("missing or wrong HMAC (not written with this deployment's store secret)")
        return doc

    # -- API -----------------------------------------------------------------------------------------
    def put(self, doc: Document, namespace: Namespace) -> None:
        with self._lock:
            self._docs[(self._scope(namespace), doc.id)] = doc
            self._usage[(namespace.folder_name, doc.id)] = (doc.owner, doc.tokens)
        data = self._encode(doc, namespace)
        if self.folder is not None:
            folder = self._dir(namespace)
            tmp = folder / f".tmp-{doc.id}.{os.getpid()}.{threading.get_ident()}"
            try:
                private_mkdir(folder)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(data)
                os.replace(tmp, self._path(namespace, doc.id))
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                self.write_errors += 1
                log.warning("cannot write document record %s: %s", doc.id, exc)
        if self.redis is not None:
            self.redis.put_record("doc", self._redis_ident(namespace, doc.id), data)

    def get(self, doc_id: str, namespace: Namespace) -> Document | None:
        """The document ``doc_id`` of ``namespace`` (only that namespace), or None."""
        if not is_document_id(doc_id):
            return None
        slot = (self._scope(namespace), doc_id)
        with self._lock:
            doc = self._docs.get(slot)
        if doc is not None:
            return doc
        doc = self._load_local(doc_id, namespace)
        if doc is None and self.redis is not None:
            doc = self._load_redis(doc_id, namespace)
        if doc is not None:
            with self._lock:
                self._docs[slot] = doc
        return doc

    def resolve(self, doc_id: str, namespace: Namespace) -> tuple[Document, Namespace] | None:
        """A document a request of ``namespace`` may use: its own, else a shared one (with where it is)."""
        for where in (namespace, Namespace.shared()):
            doc = self.get(doc_id, where)
            if doc is not None:
                return doc, where
        return None

    def delete(self, doc_id: str, namespace: Namespace) -> Document | None:
        """Remove the record of ``doc_id`` from ``namespace`` everywhere; the removed document or None."""
        doc = self.get(doc_id, namespace)
        if doc is None:
            return None
        with self._lock:
            self._docs.pop((self._scope(namespace), doc_id), None)
            self._usage.pop((namespace.folder_name, doc_id), None)
        if self.folder is not None:
            try:
                self._path(namespace, doc_id).unlink(missing_ok=True)
            except OSError as exc:
                self.write_errors += 1
                log.warning("cannot delete document record %s: %s", doc_id, exc)
        if self.redis is not None:
            self.redis.delete_record("doc", self._redis_ident(namespace, doc_id))
        return doc

    def _load_local(self, doc_id: str, namespace: Namespace) -> Document | None:
        if self.folder is None:
            return None
        try:
            return self._decode(self._path(namespace, doc_id).read_text(encoding="utf-8"), namespace)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable document record %s: %s", doc_id, exc)
            return None

    def _load_redis(self, doc_id: str, namespace: Namespace) -> Document | None:
        assert self.redis is not None
        data = self.redis.get_record("doc", self._redis_ident(namespace, doc_id))
        if data is None:
            return None
        try:
            return self._decode(data, namespace)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable document record %s in Redis: %s", doc_id, exc)
            return None

    def list(self, namespace: Namespace) -> list[Document]:
        """Documents of ``namespace`` known to this process (memory and its disk folder)."""
        if self.folder is not None and self._dir(namespace).is_dir():
            for path in self._dir(namespace).glob("doc-*.json"):
                self.get(path.stem, namespace)
        scope = self._scope(namespace)
        with self._lock:
            mine = [d for (s, _), d in self._docs.items() if s == scope]
        return sorted(mine, key=lambda d: (d.created, d.id))

    def load_all(self) -> None:
        """Count the records of the disk folder (every namespace) in :meth:`usage`, so a tenant's quota
        includes what earlier runs of this server stored (records only in Redis are other servers')."""
        if self.folder is None or not self.folder.is_dir():
            return
        for path in [*self.folder.glob("doc-*.json"), *self.folder.glob("ns-*/doc-*.json")]:
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
                owner, tokens = str(raw["owner"]), int(raw["tokens"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable document record %s: %s", path.name, exc)
                continue
            folder = "" if path.parent == self.folder else path.parent.name
            with self._lock:
                self._usage.setdefault((folder, path.stem), (owner, tokens))

    def usage(self, owner: str) -> tuple[int, int]:
        """(documents, tokens) the tenant ``owner`` has uploaded (in its namespaces and shared) that this
        server registered or found in its folder at start (:meth:`load_all`)."""
        with self._lock:
            mine = [tokens for who, tokens in self._usage.values() if who == owner]
        return len(mine), sum(mine)

    def known(self, doc_id: str, namespace: Namespace) -> bool:
        """Whether ``doc_id`` of ``namespace`` counts in its owner's :meth:`usage` already."""
        with self._lock:
            return (namespace.folder_name, doc_id) in self._usage

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)

    @staticmethod
    def new(text: str, tokens: int, chunk_ids: list[str], shared: bool = False, owner: str = "") -> Document:
        return Document(document_id(text), text, tokens, list(chunk_ids), int(time.time()), shared, owner)
