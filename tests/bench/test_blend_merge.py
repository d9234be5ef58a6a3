"""Merging blend runs split over processes (``semkv bench blend --merge``).

Injected: ``blend.json`` files as ``--skip`` shards write them (hand-made per-question records of two
rows), one shard whose last row stopped a question early, a shard of another split, a shard repeating a
question, and a shard run under the shared lock. Must happen: the merged summary equals the summary of
all records as one run (cut per shard to the questions every row finished); other settings or a repeated
question are a ValueError naming the problem; a shared-lock shard marks the timings as not valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from semkv.bench.blend import merge_runs, summarise_all


def _record(qid: str, f1: float, ttft: float = 1.0) -> dict:
    return {
        "id": qid,
        "text": "x",
        "extracted": "x" if f1 else "y",
        "em": float(f1 == 1.0),
        "f1": f1,
        "em_raw": 0.0,
        "f1_raw": f1,
        "ttft_s": ttft,
        "prompt_tokens": 100,
        "recomputed": 15,
        "loop": False,
        "kl": 0.1,
        "top1": True,
    }


def _shard(
    folder: Path, skip: int, full: list[float], row: list[float], split: str = "test", lock: str = "exclusive"
) -> Path:
    ids = [f"q{skip + i}" for i in range(len(full))]
    payload = {
        "suite": "blend",
        "config": {
            "lock": lock,
            "no_lock": False,
            "skip": skip,
            "model": "smollm2-135m",
            "workloads": [{"split": split, "split_seed": 16, "skip": skip, "target_tokens": 4096, "seed": 0}],
        },
        "rows": [],
        "per_question": {
            "hotpotqa": {
                "full prefill": [_record(q, f, 4.0) for q, f in zip(ids, full, strict=True)],
                "query 0.15": [_record(q, f, 1.0) for q, f in zip(ids, row, strict=False)],
            }
        },
    }
    path = folder / f"skip{skip}" / "blend.json"
    path.parent.mkdir()
    path.write_text(json.dumps(payload))
    return path


def test_merged_shards_summarise_as_one_run(tmp_path: Path) -> None:
    # the row of the first shard stopped before its last question (q2): q2 is left out of every row,
    # and the second shard's records stay paired with their own full-prefill records
    first = _shard(tmp_path, 0, [1.0, 0.0, 0.5], [1.0, 0.0])
    second = _shard(tmp_path, 3, [0.0, 1.0, 0.5], [1.0, 1.0, 0.0])
    merged = merge_runs([first, second])
    ids = ["q0", "q1", "q3", "q4", "q5"]
    full = [_record(q, f, 4.0) for q, f in zip(ids, [1.0, 0.0, 0.0, 1.0, 0.5], strict=True)]
    row = [_record(q, f) for q, f in zip(ids, [1.0, 0.0, 1.0, 1.0, 0.0], strict=True)]
    expected = summarise_all(
        "hotpotqa", ["full prefill", "query 0.15"], {"full prefill": full, "query 0.15": row}
    )
    got = summarise_all("hotpotqa", merged.labels["hotpotqa"], merged.results["hotpotqa"])
    assert got == expected
    assert [r["id"] for r in merged.results["hotpotqa"]["query 0.15"]] == ids
    assert got[1]["n"] == 5 and got[1]["gained"] == 1 and got[1]["lost"] == 1
    assert got[1]["speedup"] == pytest.approx(4.0)
    assert merged.timings_valid
    assert [s["skip"] for s in merged.sources] == [0, 3]


def test_a_shard_of_another_split_is_refused(tmp_path: Path) -> None:
    first = _shard(tmp_path, 0, [1.0], [1.0])
    other = _shard(tmp_path, 1, [1.0], [1.0], split="dev")
    with pytest.raises(ValueError, match="other workload settings"):
        merge_runs([first, other])


def test_a_question_in_two_shards_is_refused(tmp_path: Path) -> None:
    first = _shard(tmp_path, 0, [1.0, 0.0], [1.0, 0.0])
    overlapping = _shard(tmp_path, 1, [0.0], [0.0])  # q1 again
    with pytest.raises(ValueError, match="q1 .* occurs twice"):
        merge_runs([first, overlapping])


def test_a_shared_lock_shard_marks_timings_not_valid(tmp_path: Path) -> None:
    merged = merge_runs([_shard(tmp_path, 0, [1.0], [1.0]), _shard(tmp_path, 1, [1.0], [1.0], lock="shared")])
    assert not merged.timings_valid


def test_no_files_and_foreign_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_runs([])
    foreign = tmp_path / "sparse.json"
    foreign.write_text(json.dumps({"suite": "sparse", "rows": []}))
    with pytest.raises(ValueError, match="not a blend.json"):
        merge_runs([foreign])
