"""API keys: who is asking (the tenant), and what the key may do.

``semkv serve --api-keys FILE`` reads one key per line::

    # KEY                 TENANT   [PERMISSIONS]
    sk-alice-0123456789   alice
    sk-ops-9876543210     ops      shared,metrics

A client sends its key as ``Authorization: Bearer KEY`` (what the ``openai`` client does with
``api_key=``). The tenant enters every store key, the share index and the document registry
(:class:`semkv.store.keys.Namespace`), so tenants never reuse each other's KV. Permissions:
``shared`` lets the key publish documents every tenant can use (``"shared": true`` on upload),
``metrics`` lets it read ``/metrics`` (counters over every tenant). Without a key file there is one
anonymous tenant that may do everything, as before keys existed.

Keys are compared by their sha256 (a dictionary lookup), never character by character.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PERMISSIONS = ("shared", "metrics")
MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Principal:
    """The caller of one request: its tenant ("" = anonymous) and what its key allows."""

    tenant: str
    can_publish: bool = False
    can_read_metrics: bool = False


ANONYMOUS = Principal("", can_publish=True, can_read_metrics=True)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class APIKeys:
    """Key digest -> :class:`Principal`."""

    def __init__(self, principals: dict[bytes, Principal]) -> None:
        if not principals:
            raise ValueError("an API key file needs at least one key")
        self._principals = dict(principals)

    def __len__(self) -> int:
        return len(self._principals)

    @property
    def tenants(self) -> set[str]:
        return {p.tenant for p in self._principals.values()}

    @classmethod
    def parse(cls, text: str, source: str = "API key file") -> APIKeys:
        """``KEY TENANT [PERMISSIONS]`` lines (``#`` starts a comment); a ValueError naming the line."""
        principals: dict[bytes, Principal] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split()
            where = f"{source} line {number}"
            if len(fields) not in (2, 3):
                raise ValueError(f"{where}: expected 'KEY TENANT [PERMISSIONS]', got {len(fields)} fields")
            key, tenant = fields[0], fields[1]
            if len(key) < MIN_KEY_CHARS:
                raise ValueError(f"{where}: a key must have at least {MIN_KEY_CHARS} characters")
            if not TENANT_PATTERN.match(tenant):
                raise ValueError(
                    f"{where}: tenant {tenant!r} must be 1-64 letters, digits, '.', '_' or '-' "
                    "(starting with a letter or digit)"
                )
            permissions = set(fields[2].split(",")) if len(fields) == 3 else set()
            unknown = sorted(permissions - set(PERMISSIONS))
            if unknown:
                raise ValueError(f"{where}: unknown permissions {unknown}; known: {', '.join(PERMISSIONS)}")
            digest = _digest(key)
            if digest in principals:
                raise ValueError(f"{where}: the same key appears twice")
            principals[digest] = Principal(tenant, "shared" in permissions, "metrics" in permissions)
        return cls(principals)

    @classmethod
    def from_file(cls, path: str | Path) -> APIKeys:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            mode = path.stat().st_mode & 0o777
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the API key file {path}: {exc}") from None
        if mode & 0o077:
            log.warning("the API key file %s is readable by other users (mode %o); chmod 600 it", path, mode)
        return cls.parse(text, str(path))

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of an ``Authorization: Bearer KEY`` header value, or None (missing / unknown)."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._principals.get(_digest(key.strip()))
