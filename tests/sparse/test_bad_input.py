"""Bad sparse-decode input is refused with a clear ValueError, before any work is done.

Injected: unknown policy names, budgets that are zero, negative, above 1 as a fraction, of the
wrong type; bad policy and config settings; a policy that needs prefill queries without them.
Must happen: ValueError naming the problem.
"""

from __future__ import annotations

import pytest
import torch

from semkv.request import GenerateRequest
from semkv.sparse import Budget, KeyKeyPolicy, SparseConfig, SparseDecoder, make_policy
from semkv.sparse.quest import QuestPolicy


@pytest.mark.parametrize("sparse", ["keyky", "DENSE", "", "random"])
def test_unknown_policy(sparse):
    with pytest.raises(ValueError, match="unknown sparse policy"):
        GenerateRequest(prompt="hi", sparse=sparse)
    with pytest.raises(ValueError, match="unknown sparse policy"):
        make_policy(sparse)


@pytest.mark.parametrize(
    ("name", "option"), [("probe", "exact_layer"), ("keykey", "anchors"), ("quest", "_x")]
)
def test_unknown_policy_option(name, option):
    """An option the policy has no public field for is a ValueError naming it (not a TypeError)."""
    with pytest.raises(ValueError, match=f"unknown option.*{option}"):
        make_policy(name, **{option: 1})


@pytest.mark.parametrize("budget", [0, 0.0, -0.1, 1.5, -3, True, "0.1", float("nan")])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="kv_budget"):
        GenerateRequest(prompt="hi", sparse="keykey", kv_budget=budget)


def test_no_budget_means_the_default_on_a_request_but_not_on_a_budget():
    """kv_budget=None on a request = the calibrated/default budget; a Budget itself needs a value."""
    GenerateRequest(prompt="hi", sparse="keykey", kv_budget=None)
    with pytest.raises(ValueError, match="kv_budget"):
        Budget(None)


@pytest.mark.parametrize("budget, blocks", [(0.1, 7), (1.0, 64), (16, 1), (17, 2), (1, 1)])
def test_budget_blocks(budget, blocks):
    assert Budget(budget).blocks(1024, 16) == blocks


def test_default_is_auto():
    """sparse="auto" by default: dense without a calibrated profile (tests/sparse/test_auto.py)."""
    request = GenerateRequest(prompt="hi")
    assert request.sparse == "auto" and request.kv_budget is None  # None = calibrated budget, else 0.1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"head_pool": "median"}, "head_pool must be one of"),
        ({"page_scorer": "bm25"}, "page_scorer must be one of"),
        ({"hierarchy": (0.1, 0.2, 0.5)}, "hierarchy ratios must satisfy"),
        ({"hierarchy": (0.5, 0.2, 0.0)}, "hierarchy ratios must satisfy"),
        ({"anchor_tokens": 0}, "anchor_tokens, pages_per_chunk and chunks_per_grid must be >= 1"),
        ({"pages_per_chunk": 0}, "anchor_tokens, pages_per_chunk and chunks_per_grid must be >= 1"),
    ],
)
def test_bad_keykey_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyKeyPolicy(**kwargs)


def test_bad_quest_and_config():
    with pytest.raises(ValueError, match="aggregate must be one of"):
        QuestPolicy(aggregate="sum")
    for kwargs, message in (
        ({"sink_blocks": -1}, "sink_blocks must be >= 0"),
        ({"window_tokens": 0}, "window_tokens must be >= 1"),
        ({"resident_factor": 0.5}, "resident_factor must be >= 1"),
        ({"kv_budget": 2.0}, r"kv_budget as a fraction must be in \(0, 1\]"),
        ({"dense_layers": (-1,)}, "dense_layers must be layer indices"),
    ):
        with pytest.raises(ValueError, match=message):
            SparseConfig(**kwargs)


def test_policy_needing_prefill_queries_refuses_without_them(tokenizer):
    from semkv.models import Runtime, adapter_for
    from tests.conftest import tiny_hf_model

    runtime = Runtime(adapter_for("llama")(tiny_hf_model("llama", len(tokenizer))), torch.float32)
    cache = runtime.new_cache(80)
    runtime.prefill(cache, list(range(5, 70)))
    decoder = SparseDecoder(make_policy("snapkv"), SparseConfig(kv_budget=0.2, window_tokens=6), 4)
    with pytest.raises(ValueError, match="captured at prefill"):
        runtime.decode(cache, 5, decoder)
