"""A stored KV entry and its on-the-wire format.

Format (one file on disk, one value in Redis)::

    b"SEMKV\\x00\\x01\\x00"  | u64 little-endian header length | header JSON | safetensors payload

The header names the entry (key, kind, fingerprint, block size, parent, metadata)
and carries the sha256 of the payload and of the header itself; :func:`decode`
checks the magic, the format version and both checksums, and raises
:class:`CorruptEntry` on any mismatch so a damaged entry is a miss, never wrong KV.

Checksums stop accidents, not an attacker: keys, fingerprints and checksums are all
computable from public data. A deployment that sets a **store secret** signs every
entry it writes: the header carries ``hmac`` = HMAC-SHA256(secret, canonical header
without its checksums), which covers the payload through ``payload_sha256``. Decoding
with the secret raises :class:`UnauthenticatedEntry` (a :class:`CorruptEntry`) for an
entry without a valid HMAC, so whoever can write to the disk folder or to Redis but
does not hold the secret can only cause misses. :func:`check_tensors` checks what the
HMAC cannot: that a decoded entry's KV has the model's shape and is finite.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from semkv.store.keys import FORMAT_VERSION, EntryKey, EntryKind, is_valid_key

MAGIC = b"SEMKV\x00\x01\x00"


class CorruptEntry(ValueError):
    """Raised when stored bytes are not a valid entry of this format version."""


class UnauthenticatedEntry(CorruptEntry):
    """Raised when a store secret is set and an entry carries no valid HMAC under it."""


HMAC_FIELD = "hmac"


@dataclass
class KVEntry:
    """KV of ``n`` tokens of every layer.

    k: [L, kvh, n, d] pre-RoPE keys; v: [L, kvh, n, d] values (the KV dtype).
    extras: named side tensors (a block's key summary, LSH signatures, ...).
    meta: JSON-able metadata (positions it was computed at, text, ...).
    """

    key: EntryKey
    kind: EntryKind
    fingerprint: str
    token_ids: list[int]
    k: Tensor
    v: Tensor
    block_size: int = 0
    parent: EntryKey | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(
                f"k and v must both be [L, kvh, n, d]; got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
            )
        if self.k.shape[2] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids for KV of {self.k.shape[2]} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes held in tensors (KV + extras)."""
        total = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        return total + sum(t.numel() * t.element_size() for t in self.extras.values())


def encode(entry: KVEntry, secret: bytes | None = None) -> bytes:
    """The entry's bytes; with ``secret``, its header carries an HMAC under it."""
    tensors = {
        "k": entry.k.contiguous(),
        "v": entry.v.contiguous(),
        "token_ids": torch.tensor(entry.token_ids, dtype=torch.int64),
    }
    tensors.update({f"x.{name}": t.contiguous() for name, t in entry.extras.items()})
    payload = st_save(tensors)
    fields = {
        "format_version": FORMAT_VERSION,
        "key": entry.key,
        "kind": entry.kind.value,
        "fingerprint": entry.fingerprint,
        "block_size": entry.block_size,
        "parent": entry.parent,
        "meta": entry.meta,
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    fields = json.loads(json.dumps(fields))  # normalized: what decode will parse back
    if secret is not None:
        fields[HMAC_FIELD] = _hmac(secret, fields)
    fields[HEADER_CHECKSUM] = _header_digest(fields)
    header = json.dumps(fields, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(header)) + header + payload


HEADER_CHECKSUM = "header_sha256"


def _header_digest(fields: dict[str, Any]) -> str:
    """sha256 of the header's canonical JSON without its own checksum field."""
    body = {name: value for name, value in fields.items() if name != HEADER_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _hmac(secret: bytes, fields: dict[str, Any]) -> str:
    """HMAC-SHA256 of the header's canonical JSON without its checksum and HMAC fields."""
    body = {name: value for name, value in fields.items() if name not in (HEADER_CHECKSUM, HMAC_FIELD)}
    return hmac.new(secret, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def check_hmac(header: dict[str, Any], secret: bytes) -> None:
    """Raise :class:`UnauthenticatedEntry` unless ``header`` carries the HMAC of ``secret``."""
    got = header.get(HMAC_FIELD)
    if not isinstance(got, str) or not hmac.compare_digest(got, _hmac(secret, header)):
        raise UnauthenticatedEntry("missing or wrong HMAC (written without this deployment's store secret)")


def decode(data: bytes, secret: bytes | None = None) -> KVEntry:
    """Bytes -> entry; :class:`CorruptEntry` for anything damaged, truncated or of another version,
    :class:`UnauthenticatedEntry` when ``secret`` is given and the entry is not signed with it."""
    header, payload = _split(data)
    if secret is not None:
        check_hmac(header, secret)
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise CorruptEntry("payload checksum mismatch")
    try:
        tensors = st_load(payload)
    except Exception as exc:  # safetensors raises its own error type for a malformed payload
        raise CorruptEntry(f"unreadable payload: {exc}") from exc
    try:
        token_ids = tensors.pop("token_ids")
        if token_ids.dim() != 1 or token_ids.dtype != torch.int64:
            raise ValueError("token_ids must be a 1-D int64 tensor")
        k, v = tensors.pop("k"), tensors.pop("v")
        if not (k.is_floating_point() and v.is_floating_point()):
            raise ValueError("k and v must be floating point")
        if not isinstance(header["meta"], dict) or not isinstance(header["fingerprint"], str):
            raise ValueError("meta must be an object and fingerprint a string")
        return KVEntry(
            key=EntryKey(header["key"]),
            kind=EntryKind(header["kind"]),
            fingerprint=header["fingerprint"],
            token_ids=token_ids.tolist(),
            k=k,
            v=v,
            block_size=int(header["block_size"]),
            parent=header["parent"],
            extras={name[2:]: t for name, t in tensors.items() if name.startswith("x.")},
            meta=header["meta"],
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise CorruptEntry(f"inconsistent entry: {exc}") from exc


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """Check magic, header and version; return (header, payload) or raise :class:`CorruptEntry`."""
    if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
        raise CorruptEntry("bad magic or truncated header")
    (header_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if header_len > len(data) - start:
        raise CorruptEntry("header length past end of data")
    try:
        header = json.loads(data[start : start + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptEntry(f"unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptEntry("header is not a JSON object")
    if header.get("format_version") != FORMAT_VERSION:
        raise CorruptEntry(f"format version {header.get('format_version')!r} is not {FORMAT_VERSION}")
    if header.get(HEADER_CHECKSUM) != _header_digest(header):
        raise CorruptEntry("header checksum mismatch")
    key, parent = header.get("key"), header.get("parent")
    if not (isinstance(key, str) and is_valid_key(key)):
        raise CorruptEntry("header names no valid key")
    if parent is not None and not (isinstance(parent, str) and is_valid_key(parent)):
        raise CorruptEntry("header names an invalid parent key")
    return header, data[start + header_len :]


def read_header(data: bytes) -> dict[str, Any]:
    """The checked header of an entry without verifying its payload (cheap: for listings).

    ``data`` may be just the first bytes of the entry, as long as they hold the header.
    """
    if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
        raise CorruptEntry("bad magic or truncated header")
    (header_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    return _split(data[: len(MAGIC) + 8 + header_len])[0]


HEADER_PEEK_BYTES = 64 * 1024  # enough for any header semkv writes (meta stays small)


@dataclass(frozen=True)
class KVShape:
    """The per-token KV shape of one model: k and v are [num_layers, num_kv_heads, n, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def check_tensors(entry: KVEntry, shape: KVShape | None) -> str | None:
    """Why a decoded entry's tensors cannot be loaded (wrong shape, non-finite values), or None."""
    k, v = entry.k, entry.v
    if shape is not None:
        want = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        if (k.shape[0], k.shape[1], k.shape[3]) != want:
            return f"KV of shape {tuple(k.shape)} does not fit the model's [L, kvh, n, d] = {want}"
    if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
        return "KV holds NaN or infinite values"
    for name, extra in entry.extras.items():
        if extra.is_floating_point() and not bool(torch.isfinite(extra).all()):
            return f"extra tensor {name!r} holds NaN or infinite values"
    return None
