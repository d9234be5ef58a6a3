"""The tiered KV store: read-through, write-through, ownership checked on every hit.

An entry read from a tier below memory (decoded from bytes someone else may have written) is also
checked for the model's KV shape and for finite values before it is served or promoted.

The tiers below memory (disk, Redis) can be written behind (``StoreConfig.write_behind``, on in ``semkv
serve``): :meth:`KVStore.put` then writes the memory tier and queues the entry for a
:class:`~semkv.store.writer.TierWriter` thread, and reads serve a queued entry until it is written.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from semkv.config import StoreConfig
from semkv.store.entry import KVEntry, KVShape, check_tensors
from semkv.store.keys import EntryKey, EntryKind
from semkv.store.tiers import DiskTier, MemoryTier, Tier
from semkv.store.writer import TierWriter

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    mismatches: int = 0  # an entry was found under the key but belongs to other tokens/model/kind
    puts: int = 0
    tier_errors: int = 0  # a tier raised; the call was treated as a miss / a skipped write
    invalid: int = 0  # a decoded entry had the wrong KV shape or non-finite values (a miss)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class KVStore:
    """Tiers fastest first. A lower-tier hit is promoted into the faster tiers.

    write_behind_bytes: when set (and the first tier is memory with tiers below it), writes to the
    tiers below memory go through a :class:`TierWriter` holding at most this many bytes of queued
    entries; None writes every tier on the caller's thread.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        fingerprint: str,
        shape: KVShape | None = None,
        write_behind_bytes: int | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers: list[Tier] = list(tiers)
        self.fingerprint = fingerprint
        self.shape = shape
        self.stats = StoreStats()
        self._closed = False
        self.writer: TierWriter | None = None
        if write_behind_bytes is not None and isinstance(self.tiers[0], MemoryTier) and len(self.tiers) > 1:
            self.writer = TierWriter(self.tiers[1:], self._put_into, write_behind_bytes)

    @classmethod
    def from_config(
        cls, config: StoreConfig, home: Path, fingerprint: str, shape: KVShape | None = None
    ) -> KVStore:
        """shape: the model's KV shape, checked on every entry decoded from disk or Redis."""
        secret = None if config.secret is None else config.secret.encode("utf-8")
        tiers: list[Tier] = [MemoryTier(config.memory_bytes)]
        if config.disk:
            tiers.append(DiskTier(Path(home) / "store", config.disk_bytes, secret=secret))
        if config.redis_url:
            from semkv.store.redis_tier import RedisTier

            tiers.append(
                RedisTier(
                    config.redis_url,
                    timeout_s=config.redis_timeout_s,
                    namespace=config.redis_namespace,
                    wait_replicas=config.redis_wait_replicas,
                    secret=secret,
                    max_value_bytes=config.redis_max_value_bytes,
                )
            )
        return cls(tiers, fingerprint, shape, config.write_behind_bytes if config.write_behind else None)

    @property
    def memory(self) -> MemoryTier | None:
        first = self.tiers[0]
        return first if isinstance(first, MemoryTier) else None

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def _owned(
        self,
        entry: KVEntry,
        key: EntryKey,
        token_ids: Sequence[int] | None,
        kind: EntryKind | None,
        expect_meta: Mapping[str, object] | None = None,
    ) -> bool:
        if entry.key != key or entry.fingerprint != self.fingerprint:
            return False
        if kind is not None and entry.kind != kind:
            return False
        if expect_meta and any(entry.meta.get(name) != value for name, value in expect_meta.items()):
            return False
        return token_ids is None or list(entry.token_ids) == list(token_ids)

    def _tier_failed(self, tier: Tier, action: str, key: str, exc: Exception) -> None:
        self.stats.tier_errors += 1
        tier.stats.errors += 1
        log.warning(
            "%s of entry %s in tier %s failed (%s: %s); treated as a miss",
            action,
            key[:12],
            tier.name,
            type(exc).__name__,
            exc,
        )

    def get(
        self,
        key: EntryKey,
        token_ids: Sequence[int] | None = None,
        kind: EntryKind | None = None,
        expect_meta: Mapping[str, object] | None = None,
        chain: bool = True,
    ) -> KVEntry | None:
        """The entry under ``key`` if it is ours and holds ``token_ids``; else None (a miss).

        expect_meta: metadata the entry must carry with these exact values (e.g. a digest
        of the whole prefix a block was computed after), checked like the token ids.
        chain: the memory tier also marks the entry's ancestors recently used; a caller reading a
        whole chain passes False and calls :meth:`touch_chain` once.
        A tier that raises is a miss, never an error to the caller.
        """
        self.stats.lookups += 1
        for depth, tier in enumerate(self.tiers):
            try:
                entry = tier.get(key, chain) if isinstance(tier, MemoryTier) else tier.get(key)
                if entry is None and depth == 0 and self.writer is not None:
                    # queued for the tiers below (ours, as we put it): back into memory if it fits
                    entry = self.writer.pending(key)
                    if entry is not None and self._owned(entry, key, token_ids, kind, expect_meta):
                        self._put_into(tier, entry, chain)
            except Exception as exc:  # a cache failure must never fail the request
                self._tier_failed(tier, "read", key, exc)
                continue
            if entry is None:
                continue
            if not self._owned(entry, key, token_ids, kind, expect_meta):
                self.stats.mismatches += 1
                log.warning(
                    "entry %s in tier %s does not match the request; treated as a miss", key[:12], tier.name
                )
                continue
            if not isinstance(tier, MemoryTier):
                problem = check_tensors(entry, self.shape)
                if problem is not None:
                    self.stats.invalid += 1
                    log.warning(
                        "entry %s in tier %s refused: %s; treated as a miss", key[:12], tier.name, problem
                    )
                    self._drop(tier, key)
                    continue
            for faster in self.tiers[:depth]:
                self._put_into(faster, entry, chain)
            self.stats.hits += 1
            return entry
        self.stats.misses += 1
        return None

    def touch_chain(self, keys: Sequence[EntryKey]) -> None:
        """Mark a prefix chain's resident blocks (``keys`` root first) most recently used in the memory
        tier, ancestors after descendants (so eviction takes leaves first)."""
        memory = self.memory
        if memory is not None:
            memory.touch_chain(keys)

    def contains(self, key: EntryKey) -> bool:
        if self.writer is not None and self.writer.pending(key) is not None:
            return True
        for tier in self.tiers:
            try:
                if key in tier:
                    return True
            except Exception as exc:
                self._tier_failed(tier, "lookup", key, exc)
        return False

    def held_by_all(self, key: EntryKey) -> bool:
        """Whether every reachable tier holds ``key`` (a tier that is down is skipped).

        Write-through callers use this, not :meth:`contains`, to decide whether to store:
        an entry kept only in memory while Redis (or the disk) was failing is written to
        it again once it is back, so other processes can reuse it.
        """
        if self.writer is not None and self.writer.pending(key) is not None:
            return True  # queued for every tier below memory
        for tier in self.tiers:
            if getattr(tier, "available", True) is False:
                continue
            try:
                if key not in tier:
                    return False
            except Exception as exc:
                self._tier_failed(tier, "lookup", key, exc)
        return True

    def _put_into(self, tier: Tier, entry: KVEntry, chain: bool = True) -> bool:
        try:
            return bool(tier.put(entry, chain) if isinstance(tier, MemoryTier) else tier.put(entry))
        except Exception as exc:  # a cache failure must never fail the request
            self._tier_failed(tier, "write", entry.key, exc)
            return False

    def put(self, entry: KVEntry, chain: bool = True) -> bool:
        """Write-through to every tier; True if at least one tier now holds the entry. ``chain``: as in
        :meth:`get`."""
        if entry.fingerprint != self.fingerprint:
            raise ValueError("entry fingerprint does not match this store's model")
        self.stats.puts += 1
        if self.writer is None:
            return any([self._put_into(tier, entry, chain) for tier in self.tiers])
        self._put_into(self.tiers[0], entry, chain)
        self.writer.submit(entry)
        return True

    def _drop(self, tier: Tier, key: EntryKey) -> None:
        """Remove an unusable entry from one tier (so a good one can be written there); never raises."""
        try:
            tier.delete(key)
        except Exception as exc:
            self._tier_failed(tier, "delete", key, exc)

    def delete(self, key: EntryKey) -> None:
        if self.writer is not None:
            self.writer.cancel(key)
        for tier in self.tiers:
            tier.delete(key)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write behind is done (at once without a writer); False on timeout."""
        return True if self.writer is None else self.writer.flush(timeout_s)

    def wait_written(self, keys: Sequence[EntryKey], timeout_s: float | None = None) -> bool:
        """Wait until the writes behind of ``keys`` are done: each is then in every tier that took it (at
        once without a writer: a put writes through). False on timeout."""
        return True if self.writer is None else self.writer.wait_for(keys, timeout_s)

    @contextmanager
    def pinned(self, keys: Sequence[EntryKey]) -> Iterator[None]:
        """Keep ``keys`` resident in the memory tier for the duration of the block."""
        memory = self.memory
        pinned = [k for k in keys if memory is not None and memory.pin(k)]
        try:
            yield
        finally:
            for k in pinned:
                memory.unpin(k)  # type: ignore[union-attr]

    def summary(self) -> dict[str, object]:
        summary: dict[str, object] = {
            "store": self.stats.as_dict(),
            "tiers": {
                t.name: {**t.stats.as_dict(), "entries": sum(1 for _ in t.keys()), "bytes": t.nbytes()}
                for t in self.tiers
            },
        }
        if self.writer is not None:
            summary["write_behind"] = {
                **self.writer.stats.as_dict(),
                "pending_entries": self.writer.pending_entries(),
                "pending_bytes": self.writer.pending_bytes(),
            }
        return summary

    def close(self) -> None:
        """Record this process's hit counters beside the disk tier (for ``semkv cache stats``); close tiers."""
        if self._closed:
            return
        self._closed = True
        if self.writer is not None:
            self.writer.close()  # writes what is queued first
        disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        if disk is not None and (self.stats.lookups or self.stats.puts):
            disk.record_usage(
                {
                    "time": time.time(),
                    "pid": os.getpid(),
                    "store": self.stats.as_dict(),
                    "tiers": {t.name: t.stats.as_dict() for t in self.tiers},
                }
            )
        for tier in self.tiers:
            tier.close()
