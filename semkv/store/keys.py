"""Content keys of stored KV entries.

A key is the sha256 of a typed, length-prefixed tuple; Python's ``hash()`` is never
used (it is salted per process). Three kinds of entry exist:

* prefix block: ``(version, "block", fingerprint, block_size, parent key, token ids)``
  — position-dependent, chained to its parent so one key names a whole prefix;
* chunk: ``(version, "chunk", fingerprint, token ids)`` — position-independent KV
  of a text computed on its own (CacheBlend);
* prompt: ``(version, "prompt", fingerprint, token ids)`` — a whole prompt kept for
  semantic sharing (SemShareKV).

**Namespaces.** Every key belongs to a :class:`Namespace` (a tenant + a per-request cache salt,
vLLM's ``cache_salt``). The default namespace (anonymous tenant, no salt) adds nothing to the
hashed tuple, so its keys are byte-identical to those of stores written before namespaces
existed; any other namespace appends one extra typed field (its scope digest, tag ``z``) to the
tuple of every key and to the prefix digests, so its keys share nothing with another namespace's.

A key alone never proves a hit: the store compares the stored token ids and
fingerprint on every read.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NewType

FORMAT_VERSION = 1

EntryKey = NewType("EntryKey", str)  # 64 lowercase hex digits


class EntryKind(StrEnum):
    BLOCK = "block"
    CHUNK = "chunk"
    PROMPT = "prompt"


SHARED_TENANT = "@shared"  # the namespace of published documents (no API-key tenant can be named so)
MAX_NAME_CHARS = 256


@dataclass(frozen=True)
class Namespace:
    """Whose cache an entry belongs to: ``tenant`` (from the API key; "" = the anonymous tenant) and
    ``salt`` (a per-request ``cache_salt``; "" = none). Requests of different namespaces never share a
    key, an index entry or a document record."""

    tenant: str = ""
    salt: str = ""

    def __post_init__(self) -> None:
        for name in ("tenant", "salt"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
            if len(value) > MAX_NAME_CHARS:
                raise ValueError(f"{name} must be at most {MAX_NAME_CHARS} characters, got {len(value)}")
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{name} is not valid Unicode text") from None

    @classmethod
    def shared(cls) -> Namespace:
        """The namespace documents are published to (readable by every tenant)."""
        return cls(tenant=SHARED_TENANT)

    @property
    def is_default(self) -> bool:
        return not self.tenant and not self.salt

    @property
    def scope(self) -> str | None:
        """None for the default namespace, else a sha256 over the length-prefixed tenant and salt."""
        if self.is_default:
            return None
        h = hashlib.sha256(b"semkv-namespace")
        for part in (self.tenant, self.salt):
            data = part.encode("utf-8")
            h.update(struct.pack("<Q", len(data)) + data)
        return h.hexdigest()

    @property
    def folder_name(self) -> str:
        """A file-name-safe name of the namespace ("" for the default one)."""
        scope = self.scope
        return "" if scope is None else f"ns-{scope[:32]}"


DEFAULT_NAMESPACE = Namespace()


@dataclass(frozen=True)
class _Scope:
    """A namespace's scope digest as a key field (its own type tag, so it equals no str field)."""

    digest: str


def _scope_fields(namespace: Namespace | None) -> tuple[object, ...]:
    scope = None if namespace is None else namespace.scope
    return () if scope is None else (_Scope(scope),)


def _encode_field(value: object) -> bytes:
    """Type-tagged, length-prefixed encoding so no two different tuples share bytes."""
    if isinstance(value, bool):
        raise TypeError("bool is not a key field")
    if isinstance(value, _Scope):
        body, tag = value.digest.encode(), b"z"
    elif isinstance(value, int):
        body, tag = str(value).encode(), b"i"
    elif isinstance(value, str):
        body, tag = value.encode(), b"s"
    elif value is None:
        body, tag = b"", b"n"
    elif isinstance(value, (list, tuple)):
        body = struct.pack(f"<{len(value)}q", *value) if value else b""
        tag = b"t"
    else:
        raise TypeError(f"unsupported key field type {type(value).__name__}")
    return tag + struct.pack("<Q", len(body)) + body


def hash_fields(*fields: object) -> EntryKey:
    h = hashlib.sha256()
    for field in fields:
        h.update(_encode_field(field))
    return EntryKey(h.hexdigest())


def block_key(
    fingerprint: str,
    block_size: int,
    parent: EntryKey | None,
    token_ids: Sequence[int],
    namespace: Namespace | None = None,
) -> EntryKey:
    """Key of a prefix block whose prefix before it is named by ``parent`` (None for the first)."""
    return hash_fields(
        FORMAT_VERSION,
        EntryKind.BLOCK.value,
        fingerprint,
        block_size,
        parent,
        list(token_ids),
        *_scope_fields(namespace),
    )


def chunk_key(fingerprint: str, token_ids: Sequence[int], namespace: Namespace | None = None) -> EntryKey:
    """Key of a position-independent chunk."""
    return hash_fields(
        FORMAT_VERSION, EntryKind.CHUNK.value, fingerprint, list(token_ids), *_scope_fields(namespace)
    )


def prompt_key(fingerprint: str, token_ids: Sequence[int], namespace: Namespace | None = None) -> EntryKey:
    """Key of a whole prompt kept for semantic sharing."""
    return hash_fields(
        FORMAT_VERSION, EntryKind.PROMPT.value, fingerprint, list(token_ids), *_scope_fields(namespace)
    )


def prefix_block_keys(
    fingerprint: str, block_size: int, token_ids: Sequence[int], namespace: Namespace | None = None
) -> list[EntryKey]:
    """Chained keys of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    keys: list[EntryKey] = []
    parent: EntryKey | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(fingerprint, block_size, parent, token_ids[start : start + block_size], namespace)
        keys.append(parent)
    return keys


def prefix_digests(
    fingerprint: str, block_size: int, token_ids: Sequence[int], namespace: Namespace | None = None
) -> list[str]:
    """For every full block, the sha256 of *all* token ids from 0 to the block's end.

    Stored in a prefix block's ``meta["prefix_sha256"]`` and compared on every hit. It
    is computed straight from the token ids, independently of the chained key
    function, so a block whose key collides with one computed after a different
    prefix (whose own token ids may be equal) is still refused.
    """
    h = hashlib.sha256(f"semkv-prefix|{FORMAT_VERSION}|{fingerprint}|{block_size}|".encode())
    scope = None if namespace is None else namespace.scope
    if scope is not None:
        h.update(f"namespace|{scope}|".encode())
    digests: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h.update(struct.pack(f"<{block_size}q", *token_ids[start : start + block_size]))
        digests.append(h.copy().hexdigest())
    return digests


PREFIX_DIGEST_META = "prefix_sha256"


def is_valid_key(key: str) -> bool:
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)
