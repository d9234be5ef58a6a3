"""Keep the memory a process frees for its next allocations (glibc's malloc), instead of handing big blocks
back to the operating system and faulting them in again.

A prefill allocates and frees large temporaries on every layer (Gemma 3 270M at 4K tokens: its MLP's
gate/up product alone is 4,096 x 4,096 bf16, 32 MiB). glibc serves any block above its mmap threshold
(128 KiB at start, raised as the process frees such blocks, at most 32 MiB) with a fresh ``mmap`` and
unmaps it on free, so every such temporary is page-faulted in, page by page, on every use, until a
long-running process has raised its threshold by itself: a fresh process's first long prefills are the
slow ones (figures: docs/history/measurements.md, "Keeping freed memory").

:func:`keep_freed_memory` sets, for the whole process: no mmap for allocations (``M_MMAP_MAX = 0``: every
block comes from the heap), no trimming of the heap's top (``M_TRIM_THRESHOLD``), and a 64 MiB pad when the
heap grows (``M_TOP_PAD``). It works for the main thread's arena (a one-shot ``semkv generate``, the demo,
the in-process benches). A thread with an arena of its own (glibc gives threads their own; the server's
engine thread) gains nothing: glibc unmaps such an arena's heaps as soon as they are empty. ``M_ARENA_MAX``
cannot fix that from here: glibc fixes its arena limit the first time a thread needs an arena, so it only
works from the environment, before the process starts. :func:`restart_with_one_arena` does that for
``semkv serve``: it replaces the process (same pid) by itself with ``MALLOC_ARENA_MAX=1`` (and glibc's
per-thread cache off, see :func:`one_arena_environment`), so the engine thread allocates from the main
arena, which keeps its memory. The cost: the process keeps its peak heap
(what a prefill's temporaries once needed stays reserved for the next one, as GPU caching allocators do).
Where the C library is not glibc it does nothing.

What a process allocates for one unusual input (a server reading a body of tens of MB: its bytes, the
parsed text, validation copies) is freed at once but, kept this way, would stay resident for good:
:func:`give_back_freed_memory` (``malloc_trim``) returns every free block to the operating system; a
server calls it after such a request (the next prefills fault their temporaries in again, once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

# mallopt parameters (glibc's <malloc.h>)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

NEVER_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: the largest trim threshold it accepts
TOP_PAD_BYTES = 64 << 20
ARENA_ENV = "MALLOC_ARENA_MAX"  # glibc's environment variable for its arena limit, read at process start
TUNABLES_ENV = "GLIBC_TUNABLES"  # glibc's tunables, read at process start
TCACHE_TUNABLE = "glibc.malloc.tcache_count"
NO_TCACHE = f"{TCACHE_TUNABLE}=0"


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring). Returns True where it was set,
    False where the C library is not glibc or refused a setting (logged)."""
    libc = _glibc()
    if libc is None:
        log.debug("not glibc: the C allocator's settings are left alone")
        return False
    settings = {
        "M_MMAP_MAX": (M_MMAP_MAX, 0),
        "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, NEVER_TRIM_BYTES),
        "M_TOP_PAD": (M_TOP_PAD, TOP_PAD_BYTES),
    }
    refused = [name for name, (param, value) in settings.items() if libc.mallopt(param, value) != 1]
    if refused:
        log.warning("glibc refused mallopt for %s: freed memory may still go back to the OS", refused)
        return False
    log.debug("glibc keeps freed memory for reuse (no mmap, no trim, 64 MiB top pad)")
    return True


def give_back_freed_memory() -> bool:
    """Return the free memory of every glibc arena to the operating system (``malloc_trim(0)``), whatever
    :func:`keep_freed_memory` set. Returns True where glibc released some, False where it had nothing to
    release or the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return bool(libc.malloc_trim(0))


def one_arena_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with ``MALLOC_ARENA_MAX=1`` and glibc's per-thread cache turned off (``tcache_count=0``
    appended to ``GLIBC_TUNABLES``, unless the user set a count there), or None where a restart would change
    nothing: the C library is not glibc, or ``MALLOC_ARENA_MAX`` is set already (by the user, whose value is
    kept, or by an earlier restart).

    Without the second setting a thread in the main arena sometimes never reuses the big blocks it frees
    (each allocation a fresh block at the heap's top, faulted in anew), depending on the process's heap
    layout; with it, it reuses them (docs/history/measurements.md, "Keeping freed memory";
    tests/test_host_memory.py)."""
    if ARENA_ENV in environ or _glibc() is None:
        return None
    tunables = environ.get(TUNABLES_ENV, "")
    if TCACHE_TUNABLE not in tunables:
        tunables = f"{tunables}:{NO_TCACHE}" if tunables else NO_TCACHE
    return {**environ, ARENA_ENV: "1", TUNABLES_ENV: tunables}


def restart_with_one_arena(command_line: Sequence[str]) -> None:
    """Replace this process by ``python -m semkv *command_line`` in :func:`one_arena_environment`
    (``MALLOC_ARENA_MAX=1``, no per-thread cache; ``os.execve``: the same pid, so a supervisor or a parent's
    handle keeps working), so that every thread allocates from glibc's main arena and
    :func:`keep_freed_memory` covers them all. Returns only where nothing is to be done."""
    environment = one_arena_environment(os.environ)
    if environment is None or not sys.executable:  # an embedded interpreter has no executable to restart
        return
    log.info(
        "restarting with %s=1 and %s=%s so that every thread keeps the memory it frees",
        ARENA_ENV,
        TUNABLES_ENV,
        environment[TUNABLES_ENV],
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "semkv", *command_line], environment)
