"""The machine-wide benchmark lock (``semkv.bench.exclusive``) on a lock file of the test's own.

Injected: a suite run wrapped by the lock, with other holders of the lock file (separate open file
descriptions, as other processes would have) taking it shared or exclusive around it.
Must happen: an exclusive run holds the lock alone and waits for shared holders, holding the
turnstile while it waits (new shared holders queue behind it); a ``--lock shared`` run shares it;
``--no-lock`` takes nothing; the lock is released when the run ends, also by an exception.
"""

from __future__ import annotations

import argparse
import fcntl
import threading
import time
from contextlib import contextmanager

import pytest

import semkv.bench as bench


@pytest.fixture
def lock_files(tmp_path, monkeypatch):
    lock, turnstile = tmp_path / "bench.lock", tmp_path / "bench.turnstile"
    monkeypatch.setattr(bench, "LOCK_PATH", lock)
    monkeypatch.setattr(bench, "TURNSTILE_PATH", turnstile)
    return lock, turnstile


def can_take(path, mode: int) -> bool:
    """Whether another holder could take ``path`` in ``mode`` right now (taken and released at once)."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


@contextmanager
def held(path, mode: int):
    with open(path, "a") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"lock": "exclusive", "no_lock": False, **kw})


def probing_run(probes: dict, seen: dict, code: int = 0):
    """A suite run that records, while it runs, which (path, mode) another holder could take."""

    def run(a):
        seen.update({name: can_take(path, mode) for name, (path, mode) in probes.items()})
        return code

    return run


def test_exclusive_run_holds_the_lock_alone(lock_files):
    lock, turnstile = lock_files
    seen: dict = {}
    probes = {"shared": (lock, fcntl.LOCK_SH), "turnstile": (turnstile, fcntl.LOCK_EX)}
    assert bench.exclusive(probing_run(probes, seen, 7))(args()) == 7
    assert seen == {"shared": False, "turnstile": True}  # turnstile only held while waiting
    assert can_take(lock, fcntl.LOCK_EX)  # released


def test_shared_run_shares_the_lock(lock_files, capsys):
    lock, _ = lock_files
    seen: dict = {}
    probes = {"shared": (lock, fcntl.LOCK_SH), "exclusive": (lock, fcntl.LOCK_EX)}
    with held(lock, fcntl.LOCK_SH):  # e.g. a test run holding it shared
        bench.exclusive(probing_run(probes, seen))(args(lock="shared"))
    assert seen == {"shared": True, "exclusive": False}
    assert "timings are not valid" in capsys.readouterr().err
    assert can_take(lock, fcntl.LOCK_EX)


def test_exclusive_run_waits_for_shared_holders_and_holds_the_turnstile(lock_files, capsys):
    lock, turnstile = lock_files
    started = threading.Event()
    result = {}

    def run(a):
        started.set()
        return 0

    with held(lock, fcntl.LOCK_SH):
        waiter = threading.Thread(target=lambda: result.update(code=bench.exclusive(run)(args())))
        waiter.start()
        deadline = time.monotonic() + 10
        while can_take(turnstile, fcntl.LOCK_EX) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not can_take(turnstile, fcntl.LOCK_EX)  # new shared holders now queue behind it
        assert not started.wait(0.3)  # it waits for the shared holder
    waiter.join(10)
    assert started.is_set() and result == {"code": 0}
    assert "waiting for other semkv work" in capsys.readouterr().err
    assert can_take(turnstile, fcntl.LOCK_EX) and can_take(lock, fcntl.LOCK_EX)


def test_no_lock_takes_nothing(lock_files):
    lock, _ = lock_files
    with held(lock, fcntl.LOCK_EX):
        assert bench.exclusive(lambda a: 3)(args(no_lock=True)) == 3


def test_lock_released_when_the_run_fails(lock_files):
    lock, _ = lock_files

    def run(a):
        raise RuntimeError("suite failed")

    for mode in ("exclusive", "shared"):
        with pytest.raises(RuntimeError, match="suite failed"):
            bench.exclusive(run)(args(lock=mode))
        assert can_take(lock, fcntl.LOCK_EX)
