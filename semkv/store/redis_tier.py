"""A Redis tier shared by several processes (or machines).

Values are :func:`semkv.store.entry.encode` bytes under ``<namespace>:kv:<key>``;
the key is a sha256 that already covers the model fingerprint, and the store
compares the entry's fingerprint and token ids on every hit, so an entry written
by one model is never served to another.

Redis is an optional, best-effort tier: it never raises to the store. Every call
has a socket timeout (no retries), and a circuit breaker turns a dead or hanging
Redis into immediate misses: after a failure the tier stops calling Redis for
``backoff`` seconds (doubling per consecutive failure, capped), then lets one
trial call through; a success closes the circuit again. Outages are logged once
per opening and counted in :class:`RedisTierStats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from semkv.store.entry import CorruptEntry, KVEntry, decode, encode
from semkv.store.keys import EntryKey, is_valid_key
from semkv.store.tiers import TierStats

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RedisTierStats(TierStats):
    """TierStats plus: ``unavailable`` calls answered as misses while the circuit was open,
    ``outages`` times the circuit opened."""

    unavailable: int = 0
    outages: int = 0


class CircuitBreaker:
    """closed --failure--> open (for ``backoff_s``) --deadline--> half-open (one trial call)
    --success--> closed, --failure--> open again with twice the backoff (at most ``max_backoff_s``)."""

    def __init__(
        self,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(
                f"need 0 < base_backoff_s <= max_backoff_s, got {base_backoff_s}, {max_backoff_s}"
            )
        self.base_backoff_s = base_backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self._failures = 0
        self._open_until = 0.0
        self._trial_running = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._failures == 0

    def allow(self) -> bool:
        """May a call go to Redis now? In the half-open state only one caller gets True."""
        with self._lock:
            if self._failures == 0:
                return True
            if self.clock() < self._open_until or self._trial_running:
                return False
            self._trial_running = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._trial_running = False

    def failure(self) -> bool:
        """Record a failed call; True when this failure opened a closed circuit (a new outage)."""
        with self._lock:
            opened = self._failures == 0
            self._failures += 1
            backoff = min(self.max_backoff_s, self.base_backoff_s * 2 ** (self._failures - 1))
            self._open_until = self.clock() + backoff
            self._trial_running = False
            return opened


def redact(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisTier:
    """Entries in Redis, behind the :class:`~semkv.store.tiers.Tier` interface.

    url: ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``).
    timeout_s: socket connect/read timeout of every call; a slow Redis is a miss.
    namespace: key prefix, so several deployments can share one Redis database.
    ttl_s: optional expiry of written entries (None: Redis's own eviction policy decides).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        timeout_s: float = 0.25,
        namespace: str = "semkv",
        ttl_s: float | None = None,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be a non-empty string without ':', got {namespace!r}")
        self.url = url
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.stats = RedisTierStats()
        self.breaker = CircuitBreaker(base_backoff_s, max_backoff_s)
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        except ValueError as exc:
            raise ValueError(f"invalid Redis URL {redact(url)!r}: {exc}") from exc
        if self.call(lambda c: c.ping(), False):
            log.info("Redis tier connected at %s", redact(url))

    # -- guarded calls -------------------------------------------------------------------------------
    def call(self, fn: Callable[[redis.Redis], T], default: T) -> T:
        """Run ``fn(client)`` unless the circuit is open; any Redis/socket error -> ``default``."""
        if not self.breaker.allow():
            self.stats.unavailable += 1
            return default
        try:
            result = fn(self.client)
        except (redis.RedisError, OSError) as exc:
            self.stats.errors += 1
            if self.breaker.failure():
                self.stats.outages += 1
                log.warning(
                    "Redis at %s is unavailable (%s: %s); serving from the local tiers, retrying in %.1f s",
                    redact(self.url),
                    type(exc).__name__,
                    exc,
                    self.breaker.base_backoff_s,
                )
            return default
        if not self.breaker.closed:
            log.warning("Redis at %s is reachable again", redact(self.url))
        self.breaker.success()
        return result

    @property
    def available(self) -> bool:
        """False while the circuit is open (Redis was found down and is not retried yet)."""
        return self.breaker.closed

    def ping(self) -> bool:
        """One guarded round trip (also a half-open trial)."""
        return bool(self.call(lambda c: c.ping(), False))

    def redis_key(self, key: str) -> str:
        return f"{self.namespace}:kv:{key}"

    # -- Tier ----------------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> KVEntry | None:
        data: Any = self.call(lambda c: c.get(self.redis_key(key)), None)
        if data is None:
            self.stats.misses += 1
            return None
        try:
            entry = decode(bytes(data))
            if entry.key != key:
                raise CorruptEntry(f"value holds entry {entry.key[:12]}, not {key[:12]}")
        except CorruptEntry as exc:
            self.stats.corrupt += 1
            self.stats.misses += 1
            log.warning("damaged Redis entry %s removed: %s", key[:12], exc)
            self.call(lambda c: c.delete(self.redis_key(key)), 0)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return entry

    def put(self, entry: KVEntry) -> bool:
        data = encode(entry)
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        # SET NX: entries are content-addressed, an existing value is the same entry.
        written = self.call(lambda c: c.set(self.redis_key(entry.key), data, nx=True, px=px), False)
        if written is False:
            return False
        if written:
            self.stats.writes += 1
            self.stats.bytes_written += len(data)
        return True

    def delete(self, key: EntryKey) -> None:
        self.call(lambda c: c.delete(self.redis_key(key)), 0)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self.call(lambda c: c.exists(self.redis_key(key)), 0))

    def _scan(self) -> list[str]:
        prefix = self.redis_key("")

        def scan(c: redis.Redis) -> list[str]:
            return [k.decode()[len(prefix) :] for k in c.scan_iter(match=f"{prefix}*", count=1000)]

        return self.call(scan, [])

    def keys(self) -> Iterator[EntryKey]:
        return iter([EntryKey(k) for k in self._scan() if is_valid_key(k)])

    def nbytes(self) -> int:
        """Bytes of the values of this namespace (a SCAN + STRLEN; 0 while Redis is unavailable)."""
        names = [self.redis_key(k) for k in self._scan()]
        if not names:
            return 0

        def lengths(c: redis.Redis) -> int:
            pipe = c.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return sum(int(n) for n in pipe.execute())

        return self.call(lengths, 0)

    def close(self) -> None:
        try:
            self.client.close()
        except (redis.RedisError, OSError):  # pragma: no cover - closing a dead connection
            pass
