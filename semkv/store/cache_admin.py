"""``semkv cache stats|clear|verify`` over the disk tier of a home folder (no model needed).

* ``stats``: entries by kind, bytes, quarantined files, and the hit rates per tier
  summed over the processes that used this store (each records its counters in
  ``store/usage.jsonl`` when it closes). Reads entry headers only.
* ``verify``: reads every entry in full, checks magic, version, checksum and key, and
  moves every damaged one to ``store/quarantine``.
* ``clear``: removes the whole store folder.
"""

from __future__ import annotations

import shutil
import struct
from collections import Counter
from pathlib import Path

from semkv.store.entry import MAGIC, CorruptEntry, decode, read_header
from semkv.store.tiers import DiskTier

HIT_FIELDS = ("hits", "misses", "corrupt", "errors", "writes", "evictions")


def _header_of(path: Path) -> dict[str, object]:
    with open(path, "rb") as fh:
        head = fh.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8:
            raise CorruptEntry("truncated header")
        (length,) = struct.unpack_from("<Q", head, len(MAGIC))
        return read_header(head + fh.read(min(length, 1 << 24)))


def usage_summary(records: list[dict[str, object]]) -> dict[str, object]:
    """Sum the per-process counters; add a hit rate (hits / (hits + misses)) per tier and for the store."""
    tiers: dict[str, Counter[str]] = {}
    store: Counter[str] = Counter()
    for record in records:
        for name, value in dict(record.get("store") or {}).items():
            if isinstance(value, int):
                store[name] += value
        for tier, counts in dict(record.get("tiers") or {}).items():
            bucket = tiers.setdefault(str(tier), Counter())
            for name in HIT_FIELDS:
                value = dict(counts).get(name, 0)
                bucket[name] += value if isinstance(value, int) else 0

    def rate(c: Counter[str]) -> float | None:
        total = c["hits"] + c["misses"]
        return round(c["hits"] / total, 4) if total else None

    return {
        "processes": len(records),
        "store": {**dict(store), "hit_rate": rate(store)},
        "tiers": {name: {**dict(c), "hit_rate": rate(c)} for name, c in sorted(tiers.items())},
    }


def cache_command(action: str, home: Path) -> dict[str, object]:
    root = Path(home) / "store"
    if action == "clear":
        existed = root.exists()
        shutil.rmtree(root, ignore_errors=True)
        return {"cleared": str(root), "existed": existed}
    if action not in ("stats", "verify"):
        raise ValueError(f"unknown cache action {action!r}")
    tier = DiskTier(root)
    if action == "stats":
        kinds: Counter[str] = Counter()
        unreadable = 0
        for key in tier.keys():
            try:
                kinds[str(_header_of(tier.path(key)).get("kind"))] += 1
            except FileNotFoundError:
                continue
            except (CorruptEntry, OSError):
                unreadable += 1
        quarantine = root / "quarantine"
        return {
            "folder": str(root),
            "entries": sum(kinds.values()),
            "by_kind": dict(kinds),
            "bytes": tier.nbytes(),
            "unreadable_headers": unreadable,
            "quarantined_files": sum(1 for _ in quarantine.iterdir()) if quarantine.is_dir() else 0,
            "swept_temp_files": tier.swept,
            "usage": usage_summary(tier.read_usage()),
        }
    checked, damaged = 0, []
    for key in list(tier.keys()):
        path = tier.path(key)
        inode = None
        try:
            data, inode = tier.read_file(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            damaged.append({"key": key, "reason": f"unreadable: {exc}"})
            tier.quarantine(path, str(exc))
            checked += 1
            continue
        checked += 1
        try:
            entry = decode(data)
            if entry.key != key:
                raise CorruptEntry("entry stored under a foreign key")
        except CorruptEntry as exc:
            damaged.append({"key": key, "reason": str(exc)})
            tier.quarantine(path, str(exc), inode)
    return {
        "folder": str(root),
        "checked": checked,
        "ok": checked - len(damaged),
        "damaged": len(damaged),
        "removed": damaged,
        "swept_temp_files": tier.swept,
    }
