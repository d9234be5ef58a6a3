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

A SIGKILL loses nothing the kernel already has, so the kills above pass without any fsync. A power
cut loses what was not synced: ``test_power_cut_keeps_only_what_was_synced`` logs, in the writer,
every fsync (of which file or folder) and every rename as it completes, and after each kill applies
what a power cut may do to everything not synced: a renamed file whose data was not fsynced before
the rename is left empty (the zero-length file of delayed allocation), a rename not followed by an
fsync of its folder is undone. The same checks must then hold — which fails if either fsync of the
write protocol is removed.
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


def _log_durability(tiers, power_log: str) -> None:
    """In the writer: log each completed fsync (the path of the file or folder) and rename."""
    log_fd = os.open(power_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    real_fsync, real_replace = tiers.os.fsync, tiers.os.replace

    def fsync(fd):
        real_fsync(fd)
        os.write(log_fd, f"sync\t{os.readlink(f'/proc/self/fd/{fd}')}\n".encode())

    def replace(src, dst):
        real_replace(src, dst)
        os.write(log_fd, f"rename\t{src}\t{dst}\n".encode())

    tiers.os.fsync = fsync
    tiers.os.replace = replace


def cut_power(power_log) -> tuple[int, int, int]:
    """Apply a power cut to what the log says was not durable; (renames, files emptied, renames undone)."""
    if not power_log.exists():  # killed before it could log (or write) anything
        return 0, 0, 0
    events = [line.split("\t") for line in power_log.read_text().splitlines()]
    renames = sum(1 for e in events if e[0] == "rename")
    emptied = undone = 0
    for i, event in enumerate(events):
        if event[0] != "rename":
            continue
        src, dst = event[1], event[2]
        data_synced = ["sync", src] in events[:i]
        name_synced = ["sync", os.path.dirname(dst)] in events[i + 1 :]
        if not name_synced:
            os.unlink(dst)
            undone += 1
        elif not data_synced:
            os.truncate(dst, 0)
            emptied += 1
    power_log.unlink()
    return renames, emptied, undone


def _child_loop(root, write_fd: int, first: int, kill_at: str | None, power_log: str | None = None) -> None:
    """Runs in the forked writer: put entries forever, report each one after put returned True."""
    import semkv.store.tiers as tiers

    if power_log is not None:
        _log_durability(tiers, power_log)
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


def run_writer(
    root, first: int, kill_at: str | None = None, delay_s: float | None = None, power_log=None
) -> list[int]:
    """Fork a writer, kill it (after ``delay_s`` or at ``kill_at``), reap it; the indices it reported."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_fd)
            _child_loop(root, write_fd, first, kill_at, None if power_log is None else str(power_log))
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


POWER_CUTS = 25


def test_power_cut_keeps_only_what_was_synced(tmp_path):
    root = tmp_path / "store"
    power_log = tmp_path / "durability.log"
    rng = random.Random(4321)
    reported: list[int] = []
    renames = emptied = undone = 0
    for cut in range(POWER_CUTS):
        reported += run_writer(root, first=cut * 10_000, delay_s=rng.uniform(0.0, 0.05), power_log=power_log)
        r, e, u = cut_power(power_log)
        renames, emptied, undone = renames + r, emptied + e, undone + u
        check_folder(root, reported)
    print(
        f"\n[power cut] {POWER_CUTS} cuts over {renames} renames: {len(reported)} reported entries all "
        f"readable; {undone} renames not yet synced undone, {emptied} files emptied"
    )
    assert reported and renames >= len(reported)
