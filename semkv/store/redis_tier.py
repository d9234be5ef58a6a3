"""A Redis tier shared by several processes (or machines): one redis-server, or a Redis Cluster.

Values are :func:`semkv.store.entry.encode` bytes under ``<namespace>:kv:{<key>}``; the key is a
sha256 that already covers the model fingerprint, and the store compares the entry's fingerprint and
token ids on every hit, so an entry written by one model is never served to another. The braces are a
Redis Cluster hash tag: every Redis key of one entry hashes to the slot of its content key, so an
entry never spans nodes (a prefix chain does, and the store checks each block of it as before).

**One node or a cluster.** The URL names one node (``redis://host:port/0``) or several seed nodes of
a cluster (``redis://h1:p1,h2:p2/0``). One node is asked whether it runs in cluster mode, so the URL
of any one cluster node works too. In cluster mode redis-py's cluster client routes each key to the
master of its slot and follows MOVED / ASK redirects (a resharded slot, a failover).

**Failures.** Redis is an optional, best-effort tier: it never raises to the store. Every call has
a socket timeout (no retries), and a circuit breaker turns a dead or hanging node into immediate
misses: after a failure the tier stops calling that node for ``backoff`` seconds (doubling per
consecutive failure, capped), then lets one trial call through; a success closes the circuit again.
In a cluster there is one breaker per master, so a dead master is a miss on its slots only while the
other masters keep serving. While a breaker is open the slot map is refreshed (at most once per
``refresh_interval_s``, independent of the backoff: a refresh that still sees the old master -- the
cluster has not promoted yet, or the node asked has a stale view -- is retried soon after), so the tier
sees a replica promoted in a failover and reads and writes its slots again at once. Outages are logged once per opening and counted in :class:`RedisTierStats`.

**Replication.** With replicas, a write is *acknowledged* (``put`` returns True) only once ``WAIT``
on the write's own connection says ``wait_replicas`` replicas hold it, so a master killed right
after an acknowledged write loses nothing: its replica, which the cluster promotes, has the entry.
A write to a master with no live replica (e.g. just after a failover, until the old master rejoins
as its replica) is stored but not acknowledged (counted ``unreplicated``); a short WAIT then opens a
breaker for that master's replication, so its writes skip WAIT for ``base_backoff_s`` (doubling while
WAIT keeps failing) instead of paying the WAIT timeout on every write. The
masters are *not* run with ``min-replicas-to-write``: a cache keeps accepting writes without a
replica, it only stops promising that they survive a second failure.

**Refusals.** A command Redis *answers* with an error (``OOM command not allowed`` under
``noeviction``, a refused write, an ACL denial) fails that call only: the node is up, so it never opens
a circuit and reads go on (counted ``refused``). Cluster answers about topology (MOVED/ASK, CLUSTERDOWN,
TRYAGAIN, READONLY from a demoted master) are failures as before. Values over ``max_value_bytes`` are
not sent at all (counted ``oversize``).

**Integrity.** With a store ``secret`` every value carries an HMAC (:mod:`semkv.store.entry`); a value
without a valid one (written by someone who can reach Redis but lacks the secret) is a miss and is
deleted.
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
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterDownError, ReadOnlyError, RedisClusterException, TryAgainError
from redis.retry import Retry

from semkv.store.entry import CorruptEntry, KVEntry, UnauthenticatedEntry, decode, encode
from semkv.store.keys import EntryKey, is_valid_key
from semkv.store.tiers import TierStats

log = logging.getLogger(__name__)

T = TypeVar("T")

# Everything a Redis call can raise when Redis (or one node) is down, hanging, or refusing.
REDIS_FAILURES = (redis.RedisError, RedisClusterException, OSError)

# Answers about the cluster's topology: the node may be down or no longer serve the slot.
TOPOLOGY_ERRORS = (ClusterDownError, AskError, TryAgainError, ReadOnlyError)


def is_refusal(exc: BaseException) -> bool:
    """True for an error *answer* to one command (OOM under ``noeviction``, an ACL denial): the node is
    up. Connection errors, timeouts and topology answers are not refusals."""
    return isinstance(exc, redis.ResponseError) and not isinstance(exc, TOPOLOGY_ERRORS)


@dataclass
class RedisTierStats(TierStats):
    """TierStats plus: ``unavailable`` calls answered as misses while a circuit was open, ``outages``
    times a circuit opened, ``failovers`` nodes seen taking over slots (a replica promoted, or a new
    master), ``unreplicated`` writes stored but not acknowledged by the replicas WAIT asked for,
    ``refused`` commands Redis answered with an error (e.g. a write under ``noeviction`` at
    ``maxmemory``), ``oversize`` values not sent (over the size cap)."""

    unavailable: int = 0
    outages: int = 0
    failovers: int = 0
    unreplicated: int = 0
    refused: int = 0
    oversize: int = 0


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
    """``url`` without its password, for logs (also a cluster URL with several hosts)."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{hosts}"))


def seed_nodes(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` nodes a ``redis://`` / ``rediss://`` URL names (one, or several comma-separated);
    ``[]`` for a ``unix://`` socket. Raises ValueError naming the URL when it is not a Redis URL."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return []
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"invalid Redis URL {redact(url)!r}: the scheme must be redis, rediss or unix")
    hosts = parts.netloc.rpartition("@")[2]
    nodes = []
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not sep:
            host, port = item, "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"invalid Redis URL {redact(url)!r}: bad node {item!r} (want host:port)")
        nodes.append((host, int(port)))
    return nodes


class RedisTier:
    """Entries in Redis (one node or a cluster), behind the :class:`~semkv.store.tiers.Tier` interface.

    url: ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``), or a cluster's seed
        nodes ``redis://[:password@]h1:p1,h2:p2/0`` (one node of a cluster is enough).
    timeout_s: socket connect/read timeout of every call; a slow Redis is a miss.
    namespace: key prefix, so several deployments can share one Redis database or cluster.
    ttl_s: optional expiry of written entries (None: Redis's own eviction policy decides).
    wait_replicas: replicas that must hold a write before it is acknowledged (WAIT); None: 1 when the
        deployment has replicas when first reached, else 0.
    wait_timeout_s: the WAIT timeout (default ``timeout_s / 2``; must be below ``timeout_s``).
    secret: the store secret; values are signed with it and unsigned values are misses.
    max_value_bytes: entries larger than this are not written to Redis (they stay in the local tiers).
    refresh_interval_s: while some master's circuit is open, the slot map is re-read at most this often
        (cluster mode), so a promoted replica is found within about this long of the promotion.
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
        wait_replicas: int | None = None,
        wait_timeout_s: float | None = None,
        secret: bytes | None = None,
        max_value_bytes: int = 64 * 1024**2,
        refresh_interval_s: float = 0.5,
    ) -> None:
        if refresh_interval_s <= 0:
            raise ValueError(f"refresh_interval_s must be positive, got {refresh_interval_s}")
        self.refresh_interval_s = refresh_interval_s
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be >= 1, got {max_value_bytes}")
        self.secret = secret
        self.max_value_bytes = max_value_bytes
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if not namespace or ":" in namespace or "{" in namespace or "}" in namespace:
            raise ValueError(
                f"namespace must be a non-empty string without ':', '{{', '}}', got {namespace!r}"
            )
        if wait_replicas is not None and (isinstance(wait_replicas, bool) or wait_replicas < 0):
            raise ValueError(f"wait_replicas must be >= 0 or None, got {wait_replicas!r}")
        wait_timeout_s = timeout_s / 2 if wait_timeout_s is None else wait_timeout_s
        if not 0 < wait_timeout_s < timeout_s:
            raise ValueError(f"wait_timeout_s must be in (0, timeout_s={timeout_s}), got {wait_timeout_s}")
        self.url = url
        self.seeds = seed_nodes(url)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        self.stats = RedisTierStats()
        self.breaker = CircuitBreaker(base_backoff_s, max_backoff_s)  # the one node, or reaching the cluster
        self.cluster = len(self.seeds) > 1
        self.client: redis.Redis | RedisCluster | None = None if self.cluster else self._node_client()
        self.wait_target = 0  # replicas each write waits for, resolved when Redis is first reached
        self._connected = False
        self._node_breakers: dict[str, CircuitBreaker] = {}
        self._replication_breakers: dict[str, CircuitBreaker] = {}
        self._masters: frozenset[str] = frozenset()
        self._last_refresh = float("-inf")
        self._refresh_lock = threading.Lock()
        if self._connect():
            log.info(
                "Redis tier connected at %s (%s, writes wait for %d replicas)",
                redact(url),
                "cluster" if self.cluster else "one node",
                self.wait_target,
            )

    # -- connecting ----------------------------------------------------------------------------------
    def _client_options(self) -> dict[str, Any]:
        return {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}

    def _node_client(self) -> redis.Redis:
        try:
            return redis.Redis.from_url(
                self.url, retry=Retry(NoBackoff(), 0), retry_on_timeout=False, **self._client_options()
            )
        except ValueError as exc:
            raise ValueError(f"invalid Redis URL {redact(self.url)!r}: {exc}") from exc

    def _cluster_client(self) -> RedisCluster:
        """redis-py's cluster client over the seed nodes (asks one for the slot map: network I/O)."""
        first, *others = self.seeds
        parts = urlsplit(self.url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        one_node = urlunsplit(parts._replace(netloc=f"{userinfo}{at}{first[0]}:{first[1]}"))
        return RedisCluster(
            url=one_node,
            startup_nodes=[ClusterNode(host, port) for host, port in others],
            retry=Retry(NoBackoff(), 0),
            require_full_coverage=False,
            **self._client_options(),
        )

    def _connect(self) -> bool:
        """Reach Redis once: detect cluster mode, build the cluster client, resolve the WAIT target.

        Guarded by :attr:`breaker`; False while Redis cannot be reached (every call is then a miss).
        """

        def connect() -> bool:
            if not self.cluster:
                assert isinstance(self.client, redis.Redis)
                try:
                    self.cluster = bool(int(self.client.info("cluster").get("cluster_enabled", 0)))
                except redis.ResponseError:  # INFO refused (ACL, a proxy): treat it as one node
                    self.cluster = False
                if self.cluster:
                    self.client.close()
                    self.client = None
            if self.cluster and self.client is None:
                self.client = self._cluster_client()
                self._note_topology()
            self.wait_target = self._resolve_wait_target()
            self._connected = True
            return True

        return self._guarded(self.breaker, f"Redis at {redact(self.url)}", connect, False)

    def _resolve_wait_target(self) -> int:
        if self.wait_replicas is not None:
            return self.wait_replicas
        if isinstance(self.client, RedisCluster):
            # CLUSTER NODES, not the slot map: CLUSTER SLOTS omits replicas until they replicated a write
            nodes = self.client.cluster_nodes()
            return 1 if any("slave" in n["flags"] and "fail" not in n["flags"] for n in nodes.values()) else 0
        assert self.client is not None
        return 1 if int(self.client.info("replication").get("connected_slaves", 0)) > 0 else 0

    # -- guarded calls -------------------------------------------------------------------------------
    def _breaker_in(self, table: dict[str, CircuitBreaker], node: str) -> CircuitBreaker:
        """``table[node]``, created with this tier's backoff settings on first use."""
        breaker = table.get(node)
        if breaker is None:
            base = self.breaker
            breaker = table.setdefault(
                node, CircuitBreaker(base.base_backoff_s, base.max_backoff_s, base.clock)
            )
        return breaker

    def _node_breaker(self, node: str) -> CircuitBreaker:
        """The circuit breaker of calls to master ``node``."""
        return self._breaker_in(self._node_breakers, node)

    def _guarded(self, breaker: CircuitBreaker, label: str, fn: Callable[[], T], default: T) -> T:
        """``fn()`` unless ``breaker`` is open; any Redis/socket error -> ``default`` (and the breaker opens)."""
        if not breaker.allow():
            self.stats.unavailable += 1
            self._maybe_refresh()
            return default
        try:
            result = fn()
        except REDIS_FAILURES as exc:
            if is_refusal(exc):
                self._refused(breaker, label, exc)
                return default
            self.stats.errors += 1
            if breaker.failure():
                self.stats.outages += 1
                log.warning(
                    "%s is unavailable (%s: %s); %s, retrying in %.1f s",
                    label,
                    type(exc).__name__,
                    exc,
                    "its slots are misses"
                    if self.cluster and breaker is not self.breaker
                    else "serving from the local tiers",
                    breaker.base_backoff_s,
                )
            self._note_topology()
            return default
        if not breaker.closed:
            log.warning("%s is reachable again", label)
        breaker.success()
        return result

    def _master_of(self, name: str) -> str | None:
        """``host:port`` of the master serving the slot of the Redis key ``name`` (cluster mode), else None."""
        if not isinstance(self.client, RedisCluster):
            return None
        try:
            return self.client.get_node_from_key(name).name
        except RedisClusterException:  # slot not covered right now
            return None

    def call(self, fn: Callable[[Any], T], default: T, key: str | None = None) -> T:
        """Run ``fn(client)`` unless the circuit is open; any Redis/socket error -> ``default``.

        key: the Redis key ``fn`` works on; in a cluster it picks the breaker of the master of its slot
        (without it, the cluster-wide breaker is used).
        """
        if not self._connected and not self._connect():
            return default
        client = self.client
        node = self._master_of(key) if key is not None else None
        if node is None:
            return self._guarded(self.breaker, f"Redis at {redact(self.url)}", lambda: fn(client), default)
        return self._guarded(self._node_breaker(node), f"Redis node {node}", lambda: fn(client), default)

    # -- cluster topology ----------------------------------------------------------------------------
    def _note_topology(self) -> None:
        """Count nodes that started serving slots since the last look (a failover) and log them."""
        if not isinstance(self.client, RedisCluster):
            return
        masters = frozenset(node.name for node in self.client.get_primaries())
        new = sorted(masters - self._masters)
        if self._masters and new:
            self.stats.failovers += len(new)
            log.warning(
                "Redis Cluster: %s now serve%s slots (failover); masters: %s",
                ", ".join(new),
                "s" if len(new) == 1 else "",
                ", ".join(sorted(masters)),
            )
        self._masters = masters

    def _maybe_refresh(self) -> None:
        """Re-read the slot map (at most once per ``refresh_interval_s``) while some master's circuit is open."""
        if not isinstance(self.client, RedisCluster) or not self._refresh_lock.acquire(blocking=False):
            return
        try:
            now = self.breaker.clock()
            if now - self._last_refresh < self.refresh_interval_s:
                return
            self._last_refresh = now
            try:
                self.client.nodes_manager.initialize()
            except REDIS_FAILURES as exc:
                log.debug("Redis Cluster slot map refresh failed: %s", exc)
                return
            self._note_topology()
        finally:
            self._refresh_lock.release()

    def nodes_down(self) -> list[str]:
        """Masters (``host:port``) whose circuit is open now (cluster mode; one node: its URL)."""
        if not self.cluster:
            return [] if self.breaker.closed else [redact(self.url)]
        return sorted(name for name in self._masters if not self._node_breaker(name).closed)

    def _refused(self, breaker: CircuitBreaker, label: str, exc: BaseException) -> None:
        """Redis answered a command with an error: that call failed, the node is up (its circuit stays
        closed, or closes: a half-open trial got an answer)."""
        self.stats.errors += 1
        self.stats.refused += 1
        breaker.success()
        if self.stats.refused == 1 or self.stats.refused % 1000 == 0:
            log.warning(
                "%s refused a command (%s: %s; %d so far); reads go on",
                label,
                type(exc).__name__,
                exc,
                self.stats.refused,
            )

    @property
    def available(self) -> bool:
        """False while Redis cannot serve anything (one node: its circuit is open; a cluster: it is not
        reached yet, or every master's circuit is open)."""
        if not self.breaker.closed or not self._connected:
            return False
        return not self.cluster or len(self.nodes_down()) < len(self._masters)

    @property
    def health(self) -> str:
        """ "up", "degraded" (some masters of a cluster down) or "down"."""
        if not self.available:
            return "down"
        return "degraded" if self.nodes_down() else "up"

    def _node_clients(self) -> list[tuple[str, CircuitBreaker, redis.Redis]]:
        """(label, breaker, client) of every master: the one node, or each master of the cluster."""
        if not self._connected and not self._connect():
            return []
        if isinstance(self.client, RedisCluster):
            cluster = self.client
            return [
                (f"Redis node {n.name}", self._node_breaker(n.name), cluster.get_redis_connection(n))
                for n in cluster.get_primaries()
            ]
        assert self.client is not None
        return [(f"Redis at {redact(self.url)}", self.breaker, self.client)]

    def ping(self) -> bool:
        """One guarded round trip to every master (also a half-open trial); True if all answered."""
        nodes = self._node_clients()
        return bool(nodes) and all(
            [bool(self._guarded(breaker, label, client.ping, False)) for label, breaker, client in nodes]
        )

    # -- keys ----------------------------------------------------------------------------------------
    def redis_key(self, key: str) -> str:
        return f"{self.namespace}:kv:{{{key}}}"

    def record_key(self, kind: str, ident: str) -> str:
        """The Redis key of a small record (e.g. ``kind="doc"``: a document's registry record)."""
        return f"{self.namespace}:{kind}:{{{ident}}}"

    # -- writes --------------------------------------------------------------------------------------
    def _replication_breaker(self, node: str) -> CircuitBreaker:
        """Open while ``node``'s replicas do not answer WAIT: its writes then skip WAIT (unacknowledged)."""
        return self._breaker_in(self._replication_breakers, node)

    def _write(self, client: Any, name: str, data: bytes, px: int | None, nx: bool) -> tuple[bool, bool]:
        """SET (+ WAIT on the same connection); returns (written, acknowledged by the replicas asked for)."""
        target = self.wait_target
        if target == 0:
            return bool(client.set(name, data, nx=nx, px=px)), True
        if isinstance(client, RedisCluster):
            master = client.get_node_from_key(name)
            node, conn = master.name, client.get_redis_connection(master)
        else:
            node, conn = redact(self.url), client
        replication = self._replication_breaker(node)
        if not replication.allow():  # its replicas did not answer WAIT lately: don't pay the WAIT timeout
            return bool(client.set(name, data, nx=nx, px=px)), False
        pipe = conn.pipeline(transaction=False)
        pipe.set(name, data, nx=nx, px=px)
        pipe.wait(target, max(1, int(self.wait_timeout_s * 1000)))
        try:
            written, replicas = pipe.execute()
        except AskError:
            # MOVED or ASK: the slot moved since the slot map was read; the cluster client follows it
            replication.failure()
            return bool(client.set(name, data, nx=nx, px=px)), False
        except BaseException as exc:
            if not is_refusal(exc):  # a refused SET (OOM) says nothing about the replicas
                replication.failure()
            raise
        if int(replicas) >= target:
            if not replication.closed:
                log.warning("Redis writes to %s are acknowledged by %d replicas again", node, target)
            replication.success()
            return bool(written), True
        if replication.failure():
            log.warning(
                "Redis writes to %s are not acknowledged (WAIT: %s of %d replicas within %.0f ms); "
                "stored without waiting, WAIT retried in %.1f s",
                node,
                replicas,
                target,
                self.wait_timeout_s * 1000,
                replication.base_backoff_s,
            )
        return bool(written), False

    def _put_bytes(self, name: str, data: bytes, nx: bool, px: int | None = None) -> bool:
        """Guarded write of one value; True when it is stored and acknowledged (see the module doc)."""
        result = self.call(lambda c: self._write(c, name, data, px, nx), None, key=name)
        if result is None:
            return False
        written, acknowledged = result
        if written:
            self.stats.writes += 1
            self.stats.bytes_written += len(data)
        if not acknowledged:
            self.stats.unreplicated += 1
        return acknowledged

    def put_record(self, kind: str, ident: str, data: str | bytes) -> bool:
        """Store a small record (overwriting); True when stored and acknowledged."""
        raw = data.encode() if isinstance(data, str) else data
        return self._put_bytes(self.record_key(kind, ident), raw, nx=False)

    def get_record(self, kind: str, ident: str) -> bytes | None:
        name = self.record_key(kind, ident)
        data = self.call(lambda c: c.get(name), None, key=name)
        return None if data is None else bytes(data)

    def delete_record(self, kind: str, ident: str) -> None:
        name = self.record_key(kind, ident)
        self.call(lambda c: c.delete(name), 0, key=name)

    # -- Tier ----------------------------------------------------------------------------------------
    def get(self, key: EntryKey) -> KVEntry | None:
        name = self.redis_key(key)
        data: Any = self.call(lambda c: c.get(name), None, key=name)
        if data is None:
            self.stats.misses += 1
            return None
        try:
            entry = decode(bytes(data), self.secret)
            if entry.key != key:
                raise CorruptEntry(f"value holds entry {entry.key[:12]}, not {key[:12]}")
        except CorruptEntry as exc:
            if isinstance(exc, UnauthenticatedEntry):
                self.stats.unauthenticated += 1
            else:
                self.stats.corrupt += 1
            self.stats.misses += 1
            log.warning("damaged Redis entry %s removed: %s", key[:12], exc)
            self.call(lambda c: c.delete(name), 0, key=name)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return entry

    def put(self, entry: KVEntry) -> bool:
        """SET NX (entries are content-addressed: an existing value is the same entry); True when Redis
        holds it and, with replicas, WAIT confirmed them (an unacknowledged write may still be stored)."""
        if entry.nbytes > self.max_value_bytes:  # not even encoded: the tensors alone are over the cap
            self.stats.oversize += 1
            return False
        data = encode(entry, self.secret)
        if len(data) > self.max_value_bytes:
            self.stats.oversize += 1
            return False
        px = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        return self._put_bytes(self.redis_key(entry.key), data, nx=True, px=px)

    def delete(self, key: EntryKey) -> None:
        name = self.redis_key(key)
        self.call(lambda c: c.delete(name), 0, key=name)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        name = self.redis_key(key)
        return bool(self.call(lambda c: c.exists(name), 0, key=name))

    def _scan(self) -> list[tuple[str, CircuitBreaker, redis.Redis, list[str]]]:
        """Per reachable master: (label, breaker, client, Redis keys of this namespace's entries on it)."""
        pattern = self.redis_key("*")
        found = []
        for label, breaker, client in self._node_clients():

            def scan(c: redis.Redis = client) -> list[str]:
                return [k.decode() for k in c.scan_iter(match=pattern, count=1000)]

            found.append((label, breaker, client, self._guarded(breaker, label, scan, [])))
        return found

    def keys(self) -> Iterator[EntryKey]:
        prefix = self.redis_key("")[:-1]  # "<namespace>:kv:{"
        stems = [name[len(prefix) : -1] for *_, names in self._scan() for name in names]
        return iter([EntryKey(k) for k in stems if is_valid_key(k)])

    def nbytes(self) -> int:
        """Bytes of the values of this namespace (SCAN + STRLEN per master; 0 for masters that are down)."""
        total = 0
        for label, breaker, client, names in self._scan():
            if not names:
                continue

            def lengths(c: redis.Redis = client, names: list[str] = names) -> int:
                pipe = c.pipeline(transaction=False)
                for name in names:
                    pipe.strlen(name)
                return sum(int(n) for n in pipe.execute())

            total += self._guarded(breaker, label, lengths, 0)
        return total

    def clear(self) -> int:
        """Delete every key of this namespace (entries and records) on every reachable master; returns how many."""
        deleted = 0
        for label, breaker, client in self._node_clients():

            def wipe(c: redis.Redis = client) -> int:
                pipe = c.pipeline(transaction=False)  # one DEL per key: a multi-key DEL must stay in one slot
                for name in c.scan_iter(match=f"{self.namespace}:*", count=1000):
                    pipe.delete(name)
                return sum(int(n) for n in pipe.execute())

            deleted += self._guarded(breaker, label, wipe, 0)
        return deleted

    def close(self) -> None:
        if self.client is None:
            return
        try:
            self.client.close()
        except REDIS_FAILURES:  # pragma: no cover - closing a dead connection
            pass
