"""The policy matrix: every registered policy through the same checks, on tiny models of a family
without and with sliding-window layers (Gemma 3: window 8, one global layer).

Injected: each policy at a budget that covers every candidate block, with the fast tier forced on
(``dense_when_covered=False``) so the real selection, residency and gather path runs; and at a 20%
budget. Must happen: at full budget the same greedy tokens and logits within 1e-4 of dense; at 20% the
budget's blocks at every selecting layer, window layers never selecting (they attend to their window).
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.sparse import POLICIES, SparseConfig, SparseDecoder, capture_prefill_queries, make_policy
from tests.conftest import tiny_hf_model

BLOCK = 4
STEPS = 10


FAMILIES = ["llama", "gemma3_text"]
# every registered policy with its defaults, and the variants that take another selection path
# (layer groups, chunk-first scoring, successor spreading, the oracle's measurement variants)
VARIANTS = [(name, {}) for name in sorted(POLICIES)] + [
    ("probe", {"groups": 2}),
    ("probe", {"chunk_keep": 2.0}),
    ("probe", {"successors": 0.9}),
    ("oracle", {"query": "previous"}),
    ("oracle", {"query": "previous", "shared": True}),
]
VARIANT_IDS = [name + "".join(f"-{k}={v}" for k, v in options.items()) for name, options in VARIANTS]


def _windows(runtime) -> tuple[int | None, ...]:
    return tuple(runtime.adapter.window(i) for i in range(runtime.num_layers))


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


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_runtime(request, tokenizer):
    model = tiny_hf_model(request.param, len(tokenizer))
    return Runtime(adapter_for(request.param)(model), torch.float32)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return torch.randint(0, len(tokenizer), (90,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def dense(tiny_runtime, prompt):
    return _decode(tiny_runtime, prompt)


@pytest.mark.parametrize(("name", "options"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("covered_by", ["fraction", "tokens"])
def test_full_budget_is_dense(name, options, covered_by, tiny_runtime, prompt, dense):
    budget = 1.0 if covered_by == "fraction" else 10_000
    config = SparseConfig(
        kv_budget=budget, window_tokens=6, dense_when_covered=False, layer_windows=_windows(tiny_runtime)
    )
    decoder = SparseDecoder(make_policy(name, **options), config, BLOCK)
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


@pytest.mark.parametrize(
    ("name", "options"),
    [v for v in VARIANTS if v[0] != "dense"],
    ids=[i for i, v in zip(VARIANT_IDS, VARIANTS, strict=True) if v[0] != "dense"],
)
def test_small_budget_attends_fewer_rows(name, options, tiny_runtime, prompt, dense):
    """Sanity of the sparse path: a 20% budget selects about 20% of the blocks at every selecting layer
    (window layers select nothing), and still decodes."""
    windows = _windows(tiny_runtime)
    config = SparseConfig(kv_budget=0.2, window_tokens=6, layer_windows=windows)
    policy = make_policy(name, **options)
    decoder = SparseDecoder(policy, config, BLOCK)
    tokens, logits = _decode(tiny_runtime, prompt, decoder)
    assert len(tokens) == STEPS and torch.isfinite(logits).all()
    budget = -(-round(0.2 * decoder.records[0].context_tokens) // BLOCK)
    selecting = tuple(i for i, w in enumerate(windows) if w is None)
    groups = len(policy.layer_groups(selecting))  # one selection per group and step
    assert groups == (len(selecting) if policy.per_layer else min(options.get("groups", 1), len(selecting)))
    for record in decoder.records:
        assert len(record.selected) == groups
        assert all(len(sel) == budget for sel in record.selected)
    assert decoder.stats()["blocks_loaded_first_step"] > 0


def test_window_layers_attend_to_exactly_their_window(tokenizer, prompt):
    """Gemma 3 tiny: at a small budget a window layer is handed the rows of its window (a cache slice,
    positions within the window of the new token), a global layer the selected blocks + sink + window."""
    model = tiny_hf_model("gemma3_text", len(tokenizer))
    runtime = Runtime(adapter_for("gemma3_text")(model), torch.float32)
    windows = _windows(runtime)
    seen: dict[int, torch.Tensor] = {}

    class Spy(SparseDecoder):
        def gather(self, layer, q_rot, cache):
            picked = super().gather(layer, q_rot, cache)
            if picked is not None:
                seen[layer] = picked[2][picked[2] < 2**62].clone()
            return picked

    decoder = Spy(
        make_policy("keykey"), SparseConfig(kv_budget=0.2, window_tokens=6, layer_windows=windows), BLOCK
    )
    cache = runtime.new_cache(len(prompt) + 2)
    runtime.prefill(cache, prompt)
    runtime.decode(cache, 5, decoder)
    new = int(cache.valid_positions()[-1])
    for layer, window in enumerate(windows):
        if window is not None:
            assert seen[layer].tolist() == list(range(new - window + 1, new + 1))
        else:
            assert seen[layer].numel() < cache.length and int(seen[layer].max()) == new
