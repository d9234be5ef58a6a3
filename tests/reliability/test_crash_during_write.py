"""A writer process killed (SIGKILL) in the middle of disk writes never leaves a readable partial entry.

Injected: a forked writer process puts entries into one disk folder in a loop and reports each key
on a pipe only after ``put`` returned True; the parent SIGKILLs it after a random delay, 60 times on
the same folder (seeded), so kills land at arbitrary points of encode / write / fsync / rename. Then,
deterministically, the writer is killed at each step of one write: inside the data fsync, just before
the rename, just after the rename (before the folder fsync), and just after ``put`` returned.

Must happen: after every kill a fresh ``DiskTier`` sweeps every temp file left behind, every ``.skv``
file in the folder decodes with correct checksums (no partial entry is ever visible), nothing is
quarantined, and every entry reported written before any kill is still readable with exactly the KV
that was written.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from semkv.store.entry import decode
from semkv.store.tiers import DiskTier
from tests.reliability.reliability_helpers import same_kv, small_entry

RANDOM_KILLS = 60


def entry_for(index: int):
    """Entry ``index``: 48 tokens, KV a deterministic function of the tokens (~1.6 KB on disk)."""
    return small_entry([index, *range(1000, 1047)], layers=2)


def _child_loop(root, write_fd: int, first: int, kill_at: str | None) -> None:
    """Runs in the forked writer: put entries forever, report each one after put returned True."""
    import semkv.store.tiers as tiers

    tier = DiskTier(root)
    if kill_at is not None:
        real_fsync, real_replace = tiers.os.fsync, tiers.os.replace
        calls = {"fsync": 0}

        def die():
            os.kill(os.getpid(), signal.SIGKILL)

        def fsync(fd):
            calls["fsync"] += 1
            if kill_at == "in_data_fsync" and calls["fsync"] == 1:
                die()
            if kill_at == "after_rename" and calls["fsync"] == 2:
                die()
            return real_fsync(fd)

        def replace(src, dst):
            if kill_at == "before_rename":
                die()
            return real_replace(src, dst)

        tiers.os.fsync = fsync  # the child is a throwaway copy of this process
        tiers.os.replace = replace
    index = first
    while True:
        if tier.put(entry_for(index)):
            if kill_at == "after_put":
                os.kill(os.getpid(), signal.SIGKILL)
            os.write(write_fd, f"{index}\n".encode())
        index += 1


def run_writer(root, first: int, kill_at: str | None = None, delay_s: float | None = None) -> list[int]:
    """Fork a writer, kill it (after ``delay_s`` or at ``kill_at``), reap it; the indices it reported."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_fd)
            _child_loop(root, write_fd, first, kill_at)
        finally:
            os._exit(1)
    os.close(write_fd)
    if delay_s is not None:
        import select

        select.select([], [], [], delay_s)  # a random kill point, not a synchronisation
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with os.fdopen(read_fd, "rb") as pipe:
        return [int(line) for line in pipe.read().split()]


def check_folder(root, reported: list[int]) -> int:
    """Sweep, then check every file and every reported entry; returns how many temp files were swept."""
    tier = DiskTier(root)
    assert not list(root.glob(f"*/{DiskTier.TMP_PREFIX}*")), "temp files survived the sweep"
    for path in root.glob(f"*/*{DiskTier.SUFFIX}"):
        entry = decode(path.read_bytes())  # raises CorruptEntry on a partial file
        assert tier.path(entry.key) == path
    for index in reported:
        expected = entry_for(index)
        got = tier.get(expected.key)
        assert got is not None and same_kv(got, expected), f"reported entry {index} lost or changed"
    assert tier.stats.corrupt == 0 and not (root / "quarantine").exists()
    return tier.swept


def test_random_sigkills_never_expose_partial_entries(tmp_path):
    root = tmp_path / "store"
    rng = random.Random(1234)
    reported: list[int] = []
    swept_total = 0
    mid_write_kills = 0
    for kill in range(RANDOM_KILLS):
        got = run_writer(root, first=kill * 10_000, delay_s=rng.uniform(0.0, 0.06))
        reported += got
        swept = check_folder(root, reported)
        swept_total += swept
        mid_write_kills += swept > 0
    print(
        f"\n[crash] {RANDOM_KILLS} SIGKILLs, {mid_write_kills} left a temp file (killed mid-write), "
        f"{swept_total} temp files swept, {len(reported)} reported entries all readable"
    )
    assert len(reported) > 0
    assert mid_write_kills > 0, "no kill landed inside a write: the test did not exercise the fault"


@pytest.mark.parametrize("kill_at", ["in_data_fsync", "before_rename", "after_rename", "after_put"])
def test_kill_at_each_step_of_a_write(tmp_path, kill_at):
    root = tmp_path / "store"
    DiskTier(root).put(entry_for(0))  # one entry reported written before the crash
    got = run_writer(root, first=1, kill_at=kill_at)
    assert got == []  # killed during the first write, before reporting it
    temp_left = list(root.glob(f"*/{DiskTier.TMP_PREFIX}*"))
    assert bool(temp_left) == (kill_at in ("in_data_fsync", "before_rename"))
    swept = check_folder(root, [0])
    assert swept == len(temp_left)
    final = DiskTier(root)
    # a rename that happened is a whole entry; one that did not happen left nothing visible
    assert (entry_for(1).key in final) == (kill_at in ("after_rename", "after_put"))
    if entry_for(1).key in final:
        assert same_kv(final.get(entry_for(1).key), entry_for(1))
