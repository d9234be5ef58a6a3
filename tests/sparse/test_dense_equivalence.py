"""A budget covering every block must decode exactly like dense decoding, for every policy.

Injected: each registered policy at a budget that covers every candidate block, with the
fast tier forced on (``dense_when_covered=False``) so the real selection, residency and
gather path runs. Must happen: the same greedy tokens and logits within 1e-4 of dense.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.sparse import POLICIES, SparseConfig, SparseDecoder, capture_prefill_queries, make_policy
from tests.conftest import tiny_hf_model

BLOCK = 4
STEPS = 10


def _decode(runtime, ids, decoder=None):
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    if decoder is not None:
        with capture_prefill_queries(cache, window=8, stride=16) as captured:
            logits = runtime.prefill(cache, ids)
        decoder.prefill = captured
    else:
        logits = runtime.prefill(cache, ids)
    tokens, all_logits = [], []
    for _ in range(STEPS):
        token = int(logits.argmax())
        tokens.append(token)
        logits = runtime.decode(cache, token, decoder)
        all_logits.append(logits)
    return tokens, torch.stack(all_logits)


@pytest.fixture(scope="module")
def tiny_runtime(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    return Runtime(adapter_for("llama")(model), torch.float32)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return torch.randint(0, len(tokenizer), (90,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def dense(tiny_runtime, prompt):
    return _decode(tiny_runtime, prompt)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("covered_by", ["fraction", "tokens"])
def test_full_budget_is_dense(name, covered_by, tiny_runtime, prompt, dense):
    budget = 1.0 if covered_by == "fraction" else 10_000
    config = SparseConfig(kv_budget=budget, window_tokens=6, dense_when_covered=False)
    decoder = SparseDecoder(make_policy(name), config, BLOCK)
    tokens, logits = _decode(tiny_runtime, prompt, decoder)
    assert tokens == dense[0]
    torch.testing.assert_close(logits, dense[1], atol=1e-4, rtol=0)
    stats = decoder.stats()
    assert stats["sparse_steps"] == STEPS
    if name != "dense":
        # every candidate block was attended through the fast tier
        last = decoder.records[-1]
        candidates = (last.context_tokens - 6) // BLOCK - 1
        assert all(len(sel) == candidates for sel in last.selected)


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"dense"}))
def test_small_budget_attends_fewer_rows(name, tiny_runtime, prompt, dense):
    """Sanity of the sparse path: a 20% budget selects about 20% of the blocks and still decodes."""
    decoder = SparseDecoder(make_policy(name), SparseConfig(kv_budget=0.2, window_tokens=6), BLOCK)
    tokens, logits = _decode(tiny_runtime, prompt, decoder)
    assert len(tokens) == STEPS and torch.isfinite(logits).all()
    budget = -(-round(0.2 * decoder.records[0].context_tokens) // BLOCK)
    assert all(len(sel) == budget for r in decoder.records for sel in r.selected)
    assert decoder.stats()["blocks_loaded_first_step"] > 0
