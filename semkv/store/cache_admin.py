"""``semkv cache stats|clear|verify`` over the disk tier of a home folder (no model needed)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

from semkv.store.entry import CorruptEntry, decode
from semkv.store.tiers import DiskTier


def cache_command(action: str, home: Path) -> dict[str, object]:
    root = Path(home) / "store"
    if action == "clear":
        existed = root.exists()
        shutil.rmtree(root, ignore_errors=True)
        return {"cleared": str(root), "existed": existed}
    tier = DiskTier(root)
    if action == "stats":
        kinds: Counter[str] = Counter()
        for key in tier.keys():
            entry = tier.get(key)
            if entry is not None:
                kinds[entry.kind.value] += 1
        return {
            "folder": str(root),
            "entries": sum(kinds.values()),
            "by_kind": dict(kinds),
            "bytes": tier.nbytes(),
            "damaged": tier.stats.corrupt,
            "swept_temp_files": tier.swept,
        }
    if action == "verify":
        checked, damaged = 0, []
        for key in list(tier.keys()):
            checked += 1
            path = tier.path(key)
            try:
                entry = decode(path.read_bytes())
                if entry.key != key:
                    raise CorruptEntry("entry stored under a foreign key")
            except (CorruptEntry, OSError) as exc:
                damaged.append({"key": key, "reason": str(exc)})
                tier.quarantine(path, str(exc))
        return {"folder": str(root), "checked": checked, "damaged": len(damaged), "removed": damaged}
    raise ValueError(f"unknown cache action {action!r}")
