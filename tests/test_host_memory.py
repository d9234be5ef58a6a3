"""The C allocator keeps freed memory (``semkv.host_memory``, ``EngineConfig.keep_freed_memory``).

Injected: a child process allocates, fills and frees a 64 MiB tensor, three rounds to warm up and three
more counted: the minor page faults of the counted rounds (``getrusage``). With glibc's defaults each block
is mapped fresh and faulted in page by page every round (64 MiB is above the largest mmap threshold glibc
adapts to); once freed memory is kept, the counted rounds reuse the pages of the warm-up's blocks (glibc
alternates between two free blocks of that size, so one warm-up round is not enough). Each child is its
own process because the setting is process-wide and cannot be undone. A second thread (the server's
engine thread) allocates from an arena of its own, whose memory glibc gives back however it is set, unless
the process started with ``MALLOC_ARENA_MAX=1`` (what ``semkv serve`` restarts itself with).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from semkv.cli import build_parser
from semkv.config import EngineConfig
from semkv.host_memory import (
    ARENA_ENV,
    NO_TCACHE,
    TUNABLES_ENV,
    keep_freed_memory,
    one_arena_environment,
)

BLOCK_PAGES = (64 << 20) // os.sysconf("SC_PAGE_SIZE")

CHILD = textwrap.dedent(
    """
    import gc, resource, sys, threading
    import torch
    setup = sys.argv[1]  # none | module | module-thread | engine | engine-off, then checkpoint and home
    if setup in ("module", "module-thread"):
        from semkv.host_memory import keep_freed_memory
        assert keep_freed_memory()
    elif setup in ("engine", "engine-off"):
        from semkv.engine import Engine
        Engine.from_pretrained(sys.argv[2], home=sys.argv[3], compute_dtype="float32",
                               keep_freed_memory=setup == "engine")
    def fill():
        block = torch.empty(64 << 20, dtype=torch.uint8)
        block.fill_(1)
        return block
    def rounds():
        for _ in range(3):
            block = fill(); del block; gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            block = fill(); del block; gc.collect()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    if setup == "module-thread":
        worker = threading.Thread(target=rounds); worker.start(); worker.join()
    else:
        rounds()
    """
)

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc only"
)


def faults_of_three_blocks(*args: str, one_arena: bool = False) -> int:
    env = {k: v for k, v in os.environ.items() if k not in (ARENA_ENV, TUNABLES_ENV)}
    if one_arena:  # what semkv serve restarts itself with
        env = one_arena_environment(env) or env
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=300, check=True, env=env
    )
    return int(done.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_freed_block_is_reused_without_page_faults():
    """glibc's defaults fault every 64 MiB block in again (at least half its pages each round); with
    :func:`keep_freed_memory` the three rounds take a few percent of one block's pages at most."""
    default = faults_of_three_blocks("none")
    kept = faults_of_three_blocks("module")
    assert default >= 3 * BLOCK_PAGES // 2, default
    assert kept <= BLOCK_PAGES // 20, (kept, default)


@glibc_only
def test_an_engine_keeps_freed_memory_unless_told_not_to(tiny_checkpoint_shared, tmp_path):
    """The engine sets it on CPU by default (``keep_freed_memory=True``); ``False`` leaves glibc alone."""
    on = faults_of_three_blocks("engine", str(tiny_checkpoint_shared), str(tmp_path / "on"))
    off = faults_of_three_blocks("engine-off", str(tiny_checkpoint_shared), str(tmp_path / "off"))
    assert on <= BLOCK_PAGES // 20, (on, off)
    assert off >= 3 * BLOCK_PAGES // 2, (on, off)


@glibc_only
def test_a_second_thread_keeps_freed_memory_only_with_one_arena():
    """On a thread other than the main one the setting alone changes nothing (its arena's memory goes back
    to the OS); started in :func:`one_arena_environment` (``MALLOC_ARENA_MAX=1`` and no per-thread cache) the
    thread allocates from the main arena and keeps it. With ``MALLOC_ARENA_MAX=1`` alone, 12 of 25 child
    processes on one machine faulted every block in again (each a fresh block at the heap's top); 0 of 20
    with the cache off."""
    own_arena = faults_of_three_blocks("module-thread")
    one_arena = faults_of_three_blocks("module-thread", one_arena=True)
    assert own_arena >= 3 * BLOCK_PAGES // 2, (own_arena, one_arena)
    assert one_arena <= BLOCK_PAGES // 20, (own_arena, one_arena)


@glibc_only
def test_the_one_arena_environment_adds_the_variable_once_and_keeps_a_users_value():
    """A restart adds ``MALLOC_ARENA_MAX=1`` and turns glibc's per-thread cache off (after a user's other
    tunables; a user's own cache count is kept); where the arena variable is set (by the user, or by a
    restart before) there is nothing to do, so a restarted process never restarts again."""
    assert one_arena_environment({"PATH": "/bin"}) == {
        "PATH": "/bin",
        ARENA_ENV: "1",
        TUNABLES_ENV: NO_TCACHE,
    }
    theirs = "glibc.malloc.mmap_threshold=65536"
    assert one_arena_environment({TUNABLES_ENV: theirs})[TUNABLES_ENV] == f"{theirs}:{NO_TCACHE}"
    own_count = "glibc.malloc.tcache_count=4"
    assert one_arena_environment({TUNABLES_ENV: own_count})[TUNABLES_ENV] == own_count
    assert one_arena_environment({ARENA_ENV: "1"}) is None
    assert one_arena_environment({ARENA_ENV: "4"}) is None


@glibc_only
def test_keep_freed_memory_reports_that_it_was_set():
    assert keep_freed_memory() is True


def test_engine_config_rejects_a_non_bool_keep_freed_memory(tmp_path):
    with pytest.raises(ValueError, match="keep_freed_memory"):
        EngineConfig(home=tmp_path, keep_freed_memory="no")


def test_the_cli_flag_turns_it_off():
    args = build_parser().parse_args(["generate", "--no-keep-freed-memory", "hello"])
    assert args.no_keep_freed_memory is True
    assert build_parser().parse_args(["generate", "hello"]).no_keep_freed_memory is False
