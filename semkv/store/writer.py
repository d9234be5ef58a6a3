"""Write-behind for the tiers below memory: their writes run on one background thread.

A disk write of an entry encodes it (safetensors + sha256), writes a temp file, fsyncs it, renames it
and fsyncs the folder; a Redis write sends it and may wait for replicas. For a long prompt's blocks
and share entry that is a large part of a prefill's time. Written through on the engine thread, that
time stalls every running stream. :class:`TierWriter` takes the entry instead and writes it to the lower
tiers in the background, in submission order; until it is written, the store serves it from
:meth:`TierWriter.pending`, so a reader never misses an entry it was told is stored.

The thread does no torch arithmetic (encoding reads tensor memory through pointers), so it never opens
a second OpenMP team beside the engine's (two teams on a small machine slow every later step).
Entries whose tensors are not contiguous are made contiguous on the caller's thread before queueing.

Bounded: at most ``max_pending_bytes`` of entries wait; a put beyond that waits for room (counted in
``stalls``), it never drops an entry. :meth:`flush` waits for every queued write; the store flushes on
close, and at interpreter exit for a store that was never closed.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKey
from semkv.store.tiers import Tier

log = logging.getLogger(__name__)

TierPut = Callable[[Tier, KVEntry], bool]  # writes one entry to one tier; never raises


@dataclass
class WriterStats:
    submitted: int = 0
    written: int = 0  # entries every lower tier was asked to write
    cancelled: int = 0  # deleted before their turn came
    stalls: int = 0  # puts that waited for room
    stall_s: float = 0.0
    write_s: float = 0.0  # time the thread spent writing

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def contiguous_entry(entry: KVEntry) -> KVEntry:
    """``entry``, or a copy whose tensors are contiguous (the copy runs on the caller's thread)."""
    tensors = [entry.k, entry.v, *entry.extras.values()]
    if all(t.is_contiguous() for t in tensors):
        return entry
    extras = {name: t.contiguous() for name, t in entry.extras.items()}
    return replace(entry, k=entry.k.contiguous(), v=entry.v.contiguous(), extras=extras)


class TierWriter:
    """One background thread writing queued entries to ``tiers`` with ``put_into``.

    max_pending_bytes: bytes of queued entries (not yet written to every tier) above which
    :meth:`submit` waits; an entry larger than this still goes in when the queue is empty.
    """

    def __init__(self, tiers: Sequence[Tier], put_into: TierPut, max_pending_bytes: int) -> None:
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be >= 1, got {max_pending_bytes}")
        self.tiers = list(tiers)
        self.max_pending_bytes = max_pending_bytes
        self.stats = WriterStats()
        self._put_into = put_into
        self._queue: OrderedDict[EntryKey, KVEntry] = OrderedDict()  # waiting, oldest first
        self._writing: KVEntry | None = None  # taken by the thread, being written
        self._bytes = 0  # of queued and in-flight entries
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="semkv-tier-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- caller side ------------------------------------------------------------------------------

    def submit(self, entry: KVEntry) -> None:
        """Queue ``entry`` for the lower tiers; waits while the queue holds ``max_pending_bytes``."""
        entry = contiguous_entry(entry)
        size = entry.nbytes
        with self._cond:
            if self._closed:
                raise RuntimeError("the tier writer is closed")
            if entry.key in self._queue or self._in_flight(entry.key):
                return
            if self._bytes and self._bytes + size > self.max_pending_bytes:
                self.stats.stalls += 1
                start = time.perf_counter()
                while self._bytes and self._bytes + size > self.max_pending_bytes:
                    self._cond.wait()
                self.stats.stall_s += time.perf_counter() - start
            self._queue[entry.key] = entry
            self._bytes += size
            self.stats.submitted += 1
            self._cond.notify_all()

    def pending(self, key: EntryKey) -> KVEntry | None:
        """The entry under ``key`` if it is queued or being written, else None."""
        with self._cond:
            entry = self._queue.get(key)
            if entry is None and self._in_flight(key):
                entry = self._writing
            return entry

    def cancel(self, key: EntryKey) -> None:
        """Forget a queued write of ``key``; if it is being written, wait until it is (the caller then
        deletes it from the tiers)."""
        with self._cond:
            entry = self._queue.pop(key, None)
            if entry is not None:
                self._bytes -= entry.nbytes
                self.stats.cancelled += 1
                self._cond.notify_all()
            while self._in_flight(key):
                self._cond.wait()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._writing is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_for(self, keys: Sequence[EntryKey], timeout_s: float | None = None) -> bool:
        """Wait until none of ``keys`` is queued or being written (each was written to every lower tier,
        or cancelled); writes queued before or after them need not be done. False on timeout."""
        wanted = set(keys)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while wanted & self._queue.keys() or (self._writing is not None and self._writing.key in wanted):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Write what is queued, then stop the thread (idempotent)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        atexit.unregister(self.close)

    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def pending_entries(self) -> int:
        with self._cond:
            return len(self._queue) + (self._writing is not None)

    def _in_flight(self, key: EntryKey) -> bool:
        return self._writing is not None and self._writing.key == key

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                _, entry = self._queue.popitem(last=False)
                self._writing = entry
            start = time.perf_counter()
            try:
                for tier in self.tiers:
                    self._put_into(tier, entry)
            except Exception as exc:  # put_into never raises; a bug in it must not kill the thread
                log.error("write-behind of entry %s failed: %s", entry.key[:12], exc, exc_info=exc)
            finally:
                with self._cond:
                    self._writing = None
                    self._bytes -= entry.nbytes
                    self.stats.written += 1
                    self.stats.write_s += time.perf_counter() - start
                    self._cond.notify_all()
