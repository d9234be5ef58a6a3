"""The disk tier's byte budget, and ``semkv serve``'s default for it.

Injected: 500 entries (~1.6 KB each) put into a disk tier with a 100 KB budget, one tier alone and then
two tiers on one folder taking turns (two processes sharing a home).
``semkv serve`` parsed without ``--disk-mb``.

Must hold: after every put the folder holds at most the budget (one tier) or the budget plus what the
other tier wrote since its last count (two tiers, never more than twice the budget), the newest entry
is always kept, evictions are counted; a full folder is trimmed to 90% of the budget, so it is listed
on a fraction of the puts, not on every one; ``semkv serve`` has a disk budget unless told ``--disk-mb 0``.
"""

from __future__ import annotations

from semkv.cli import build_parser
from semkv.server.command import DEFAULT_DISK_MB
from semkv.store.tiers import DiskTier
from tests.reliability.reliability_helpers import small_entry

BUDGET = 100_000
PUTS = 500


def entry(i: int):
    return small_entry([i, *range(1000, 1047)])


def test_one_tier_keeps_to_its_budget(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, budget_bytes=BUDGET)
    listings = {"n": 0}
    real = tier._files

    def counted():
        listings["n"] += 1
        return real()

    monkeypatch.setattr(tier, "_files", counted)
    for i in range(PUTS):
        e = entry(i)
        assert tier.put(e)
        assert e.key in tier
        if i % 50 == 49:
            assert DiskTier(tmp_path).nbytes() <= BUDGET
    assert tier.stats.evictions >= PUTS - BUDGET // 1500
    assert listings["n"] <= PUTS // 4, listings  # not a listing per put (the old tier listed on every one)


def test_two_tiers_on_one_folder(tmp_path):
    a, b = DiskTier(tmp_path, budget_bytes=BUDGET), DiskTier(tmp_path, budget_bytes=BUDGET)
    for i in range(PUTS):
        tier = a if i % 2 else b
        assert tier.put(entry(i))
        assert DiskTier(tmp_path).nbytes() <= 2 * BUDGET
    assert a.stats.evictions + b.stats.evictions >= PUTS - 2 * BUDGET // 1500


def test_serve_has_a_disk_budget_by_default():
    args = build_parser().parse_args(["serve"])
    assert args.disk_mb == DEFAULT_DISK_MB > 0
    assert build_parser().parse_args(["serve", "--disk-mb", "0"]).disk_mb == 0
