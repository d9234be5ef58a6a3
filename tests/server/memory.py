"""Resident memory of this process, after giving freed memory back (for memory-growth checks)."""

from __future__ import annotations

import ctypes
import gc


def rss_mb() -> float:
    """VmRSS in MiB after a garbage collection and ``malloc_trim`` (glibc keeps freed large blocks
    otherwise, which reads as growth that is not retained memory)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as is
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
