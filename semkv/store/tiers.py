"""Storage tiers behind one small interface.

A tier stores :class:`KVEntry` objects by key. ``get`` never raises for a damaged
or unreachable entry: it counts it and returns None (a miss). The store stacks
tiers fastest first and is the only caller, so a new tier (Redis) plugs in without
touching anything above the store.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from semkv.config import private_mkdir
from semkv.store.entry import CorruptEntry, KVEntry, UnauthenticatedEntry, decode, encode
from semkv.store.keys import EntryKey, is_valid_key

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    writes: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    unauthenticated: int = 0  # entries without a valid HMAC under the store secret (treated as misses)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Tier(Protocol):
    name: str
    stats: TierStats

    def get(self, key: EntryKey) -> KVEntry | None: ...

    def put(self, entry: KVEntry) -> bool: ...

    def delete(self, key: EntryKey) -> None: ...

    def __contains__(self, key: object) -> bool: ...

    def keys(self) -> Iterator[EntryKey]: ...

    def nbytes(self) -> int: ...

    def close(self) -> None: ...


class MemoryTier:
    """In-process LRU under a byte budget. Pinned entries (refcount > 0) are never evicted.

    Prefix blocks are evicted leaf first: touching a block also touches its ancestors. A caller that
    reads or writes a whole chain (a prefix lookup, a stored prompt) touches each block alone
    (``chain=False``) and then the chain once, leaf first (:meth:`touch_chain`): linear in the chain's
    length instead of quadratic.

    An entry that cannot fit without evicting pinned ones is not admitted
    (``put`` returns False): the tier is a cache and the tiers below still hold it.
    """

    name = "memory"

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        self._entries: OrderedDict[EntryKey, KVEntry] = OrderedDict()
        self._pins: dict[EntryKey, int] = {}
        self._bytes = 0
        self._pinned_bytes = 0
        self._lock = threading.RLock()

    def get(self, key: EntryKey, chain: bool = True) -> KVEntry | None:
        """The resident entry under ``key``, marked most recently used (with its ancestors unless
        ``chain`` is False); None if not resident."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._touch(entry, chain)
            self.stats.hits += 1
            self.stats.bytes_read += entry.nbytes
            return entry

    def put(self, entry: KVEntry, chain: bool = True) -> bool:
        """Admit ``entry`` (or touch it if resident), most recently used with its ancestors unless
        ``chain`` is False; False if it cannot fit without evicting pinned entries."""
        with self._lock:
            if entry.key in self._entries:
                self._touch(self._entries[entry.key], chain)
                return True
            size = entry.nbytes
            if size > self.budget_bytes:
                return False
            if not self._make_room(size):
                return False
            self._entries[entry.key] = entry
            self._touch(entry, chain)
            self._bytes += size
            self.stats.writes += 1
            self.stats.bytes_written += size
            return True

    def touch_chain(self, keys: Sequence[EntryKey]) -> None:
        """Mark the resident entries of a prefix chain (``keys`` root first) most recently used, the root
        most of all: one move per block."""
        with self._lock:
            for key in reversed(keys):
                if key in self._entries:
                    self._entries.move_to_end(key)

    def _touch(self, entry: KVEntry, chain: bool = True) -> None:
        """Mark ``entry`` and then (``chain``) its resident ancestors most recently used.

        A prefix block is useless without the blocks before it, so ancestors stay more
        recent than their descendants and eviction takes the leaves of a chain first.
        """
        self._entries.move_to_end(entry.key)
        if not chain:
            return
        parent, seen = entry.parent, 0
        while parent is not None and parent in self._entries and seen < len(self._entries):
            self._entries.move_to_end(parent)
            parent, seen = self._entries[parent].parent, seen + 1

    def _make_room(self, size: int) -> bool:
        """Evict least-recently-used unpinned entries until ``size`` more bytes fit.

        Whether room can be made is known from the pinned bytes alone, and the LRU order is walked
        only as far as the victims reach (plus any pinned entries in front of them), so a put into a
        full tier costs the entries it evicts, not the entries it holds.
        """
        if self._bytes + size <= self.budget_bytes:
            return True
        if self._pinned_bytes + size > self.budget_bytes:
            return False
        victims: list[EntryKey] = []
        freed = 0
        for key, entry in self._entries.items():
            if self._bytes - freed + size <= self.budget_bytes:
                break
            if self._pins.get(key, 0) == 0:
                victims.append(key)
                freed += entry.nbytes
        for key in victims:
            self._bytes -= self._entries.pop(key).nbytes
            self.stats.evictions += 1
        return True

    def delete(self, key: EntryKey) -> None:
        with self._lock:
            if self._pins.get(key, 0):
                raise ValueError(f"cannot delete pinned entry {key[:12]}")
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= entry.nbytes

    def pin(self, key: EntryKey) -> bool:
        """Protect ``key`` from eviction while in use; False if it is not resident."""
        with self._lock:
            if key not in self._entries:
                return False
            count = self._pins.get(key, 0)
            if count == 0:
                self._pinned_bytes += self._entries[key].nbytes
            self._pins[key] = count + 1
            return True

    def unpin(self, key: EntryKey) -> None:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise ValueError(f"unpin of entry {key[:12]} that is not pinned")
            if count == 1:
                del self._pins[key]
                self._pinned_bytes -= self._entries[key].nbytes
            else:
                self._pins[key] = count - 1

    def peek(self, key: EntryKey) -> KVEntry | None:
        """The resident entry under ``key`` without touching LRU order or counters (for checks)."""
        with self._lock:
            return self._entries.get(key)

    def pin_count(self, key: EntryKey) -> int:
        return self._pins.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> Iterator[EntryKey]:
        with self._lock:
            return iter(list(self._entries))

    def nbytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pins.clear()
            self._bytes = 0
            self._pinned_bytes = 0

    def check_invariants(self) -> None:
        """Byte count matches the entries; pins only on resident entries; budget kept unless pinned."""
        with self._lock:
            assert self._bytes == sum(e.nbytes for e in self._entries.values()), "byte count drifted"
            assert all(k in self._entries and c > 0 for k, c in self._pins.items()), "pin on a missing entry"
            pinned = sum(self._entries[k].nbytes for k in self._pins)
            assert self._pinned_bytes == pinned, "pinned byte count drifted"
            assert self._bytes <= max(self.budget_bytes, pinned), "over budget"
            assert all(e.key == k for k, e in self._entries.items()), "entry under a foreign key"


class DiskTier:
    """One file per entry under ``root/<key[:2]>/<key>.skv``.

    Writes go to a temp file in the same folder (mode 0600), are fsynced and renamed, and the
    folder is fsynced, so a reader sees either nothing or a whole entry, also after a power cut;
    temp files left by a killed writer are swept at start. Reads verify the checksum (and the HMAC
    when ``secret`` is set); a damaged or unsigned file is moved to ``root/quarantine`` and
    counted, and the read is a miss.

    budget_bytes: the oldest files are removed once the folder holds more, down to ``LOW_WATER`` of
    the budget (so a full folder is not listed on every write); the total is counted once and then
    kept up to date by this process's writes (recounted every ``RECOUNT_EVERY`` writes, so other
    processes' writes to the same folder are seen too).
    """

    name = "disk"
    SUFFIX = ".skv"
    TMP_PREFIX = ".tmp-"

    RECOUNT_EVERY = 256
    LOW_WATER = 0.9

    def __init__(self, root: Path, budget_bytes: int | None = None, secret: bytes | None = None) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.secret = secret
        self.stats = TierStats()
        self._usage: int | None = None  # bytes of entry files as last counted + written since
        self._writes_since_count = 0
        self._usage_lock = threading.Lock()
        try:
            private_mkdir(self.root)
        except OSError as exc:
            raise OSError(f"cannot create the cache folder {self.root}: {exc}") from exc
        if not os.access(self.root, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(f"the cache folder {self.root} is not readable and writable")
        self.swept = self.sweep_temp_files()

    def path(self, key: EntryKey) -> Path:
        return self.root / key[:2] / f"{key}{self.SUFFIX}"

    def sweep_temp_files(self) -> int:
        """Remove temp files of interrupted writes; returns how many.

        A temp file is stale when the process named in it is gone, or when it is older
        than ``STALE_TEMP_S`` (a pid may be reused, or belong to another host); a temp
        file of a live writer in another process is left alone so its rename succeeds.
        """
        count = 0
        for tmp in self.root.glob(f"*/{self.TMP_PREFIX}*"):
            if not self._stale_temp(tmp):
                continue
            tmp.unlink(missing_ok=True)
            count += 1
        if count:
            log.info("swept %d temp files of interrupted writes in %s", count, self.root)
        return count

    STALE_TEMP_S = 600.0

    def _stale_temp(self, tmp: Path) -> bool:
        try:
            age = time.time() - tmp.stat().st_mtime
        except FileNotFoundError:
            return False
        parts = tmp.name.split(".")
        pid = int(parts[-2]) if len(parts) >= 4 and parts[-2].isdigit() else None
        return pid is None or age > self.STALE_TEMP_S or not _pid_alive(pid)

    def _files(self) -> Iterator[Path]:
        return self.root.glob(f"*/*{self.SUFFIX}")

    def quarantine(
        self, path: Path, reason: str, inode: tuple[int, int] | None = None, unauthenticated: bool = False
    ) -> None:
        """Move a damaged file to ``root/quarantine`` (or delete it); never raises.

        inode: (st_dev, st_ino) of the damaged file that was read. If another process
        replaced the file with a good one meanwhile, the good one is put back.
        """
        moved: Path | None = None
        try:
            qdir = self.root / "quarantine"
            qdir.mkdir(exist_ok=True)
            moved = qdir / f"{path.name}.{time.time_ns()}.{os.getpid()}"
            path.rename(moved)
        except FileNotFoundError:
            return  # already gone (another reader quarantined it)
        except OSError:
            moved = None
            try:
                if inode is None or _inode(path) == inode:
                    path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove damaged cache entry %s: %s", path, exc)
        if moved is not None and inode is not None:
            try:
                if _inode(moved) != inode:  # a writer replaced it with a good file in between
                    _restore(moved, path)
                    return
            except OSError:
                pass
        if unauthenticated:
            self.stats.unauthenticated += 1
        else:
            self.stats.corrupt += 1
        log.warning("quarantined damaged cache entry %s: %s", path.name, reason)

    def read_file(self, path: Path) -> tuple[bytes, tuple[int, int]]:
        """(bytes, (st_dev, st_ino)) of one entry file, read through one open descriptor."""
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            return fh.read(), (st.st_dev, st.st_ino)

    def get(self, key: EntryKey) -> KVEntry | None:
        path = self.path(key)
        try:
            data, inode = self.read_file(path)
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as exc:
            self.stats.errors += 1
            self.stats.misses += 1
            log.warning("cannot read cache entry %s: %s", path, exc)
            return None
        try:
            entry = decode(data, self.secret)
            if entry.key != key:
                raise CorruptEntry(f"file holds entry {entry.key[:12]}, not {key[:12]}")
        except CorruptEntry as exc:
            self.quarantine(path, str(exc), inode, isinstance(exc, UnauthenticatedEntry))
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return entry

    def put(self, entry: KVEntry) -> bool:
        path = self.path(entry.key)
        if path.is_file():
            return True
        data = encode(entry, self.secret)
        tmp = path.parent / f"{self.TMP_PREFIX}{entry.key}.{os.getpid()}.{threading.get_ident()}"
        try:
            private_mkdir(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.stats.errors += 1
            log.warning("cannot write cache entry %s: %s", path, exc)
            return False
        self.stats.writes += 1
        self.stats.bytes_written += len(data)
        if self.budget_bytes is not None:
            self._account(len(data), keep=path)
        return True

    def _account(self, added: int, keep: Path) -> None:
        """Add a write to the running total; recount and evict when over the budget (or now and then)."""
        assert self.budget_bytes is not None
        with self._usage_lock:
            self._writes_since_count += 1
            if self._usage is not None:
                self._usage += added
            recount = (
                self._usage is None
                or self._usage > self.budget_bytes
                or self._writes_since_count >= self.RECOUNT_EVERY
            )
            if recount:
                self._usage = self._enforce_budget(keep)
                self._writes_since_count = 0

    def _enforce_budget(self, keep: Path) -> int:
        """Remove the oldest files until the folder holds at most ``LOW_WATER`` of the budget (if it is
        over the budget); returns the bytes left."""
        assert self.budget_bytes is not None
        files = []
        for f in self._files():
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, f))
        total = sum(size for _, size, _ in files)
        if total <= self.budget_bytes:
            return total
        target = int(self.budget_bytes * self.LOW_WATER)
        for _, size, f in sorted(files):
            if total <= target:
                break
            if f == keep:
                continue
            f.unlink(missing_ok=True)
            total -= size
            self.stats.evictions += 1
        return total

    def delete(self, key: EntryKey) -> None:
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot delete cache entry %s: %s", key[:12], exc)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and is_valid_key(key) and self.path(EntryKey(key)).is_file()

    def keys(self) -> Iterator[EntryKey]:
        for f in self._files():
            stem = f.name[: -len(self.SUFFIX)]
            if is_valid_key(stem):
                yield EntryKey(stem)

    def nbytes(self) -> int:
        total = 0
        for f in self._files():
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
        return total

    USAGE_FILE = "usage.jsonl"

    def record_usage(self, record: dict[str, object]) -> None:
        """Append one process's counters to ``root/usage.jsonl`` (one short O_APPEND write; never raises)."""
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            fd = os.open(self.root / self.USAGE_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("cannot record cache usage in %s: %s", self.root, exc)

    def read_usage(self) -> list[dict[str, object]]:
        """Every usage record written so far (damaged lines skipped)."""
        try:
            text = (self.root / self.USAGE_FILE).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        records = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def close(self) -> None:
        pass


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts as alive until reaped)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _inode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def _restore(moved: Path, path: Path) -> None:
    """Put a good file moved by mistake back at ``path`` without overwriting a newer one."""
    try:
        os.link(moved, path)
    except FileExistsError:
        pass
    moved.unlink(missing_ok=True)
