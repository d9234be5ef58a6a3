"""Every sparse policy at a small budget, checked step by step and layer by layer.

Injected: a tiny Llama (2 layers, 2 KV heads, head dim 16, KV float32), block size 4, a 200-token
prompt, kv_budget 0.1, one sink block, an 8-token window, 12 decode steps; the decoder's gather hook
wrapped to record what each layer attends to and which blocks are resident after it.
Must happen, for every policy and the probe with exact layers or shortlist rescoring (one parametrized
matrix):

* the rows a layer attends to are exactly the sink rows, the window rows (the new token's included)
  and the rows of the blocks selected for it, each once: no hidden row leaks in, none of those is left
  out, and the mask handed over with them (the runtime uses it as is) hides exactly the hidden rows;
* the selected blocks are candidates (between the sink and the window), as many as the budget gives;
* residency: every selected block is resident, no block becomes resident without being selected, and
  a group never holds more blocks than the fast tier has slots;
* bytes: ``bytes_loaded`` is the (layer, block) copies the residency changes imply times the bytes of
  one block of one layer at rest (2 * kv heads * block * head dim * 4 for float32), and
  ``resident_kv_bytes`` the resident (layer, block) pairs at the end times the same.

A Gemma 3 model whose layers are all sliding-window layers (window 8 tokens, inside the decoder's
always-attended window) decodes sparse exactly as dense: a window layer never reaches a block outside
its window, whatever the policy selects (a README claim).
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.request import GenerateRequest
from semkv.sparse import POLICIES, Budget, SparseConfig, SparseDecoder, make_policy
from semkv.sparse.index import capture_prefill_queries
from semkv.sparse.tier import HIDDEN
from tests.conftest import tiny_hf_model

BLOCK = 4
PROMPT_TOKENS = 200
STEPS = 12
CONFIG = dict(kv_budget=0.1, sink_blocks=1, window_tokens=8)
SPARSE_POLICIES = sorted(set(POLICIES) - {"dense"})
# (policy, options): every registered policy with its defaults, and variants with uneven layer groups
MATRIX = [(name, {}) for name in SPARSE_POLICIES] + [
    ("probe", {"exact_layers": (1,)}),
    ("probe", {"exact_layers": (0,), "exact_keys": True}),
    ("probe", {"rescore": 2.0}),
    ("probe", {"exact_layers": (1,), "rescore": 20.0}),  # a shortlist longer than the candidates
]
FED = [5, 17, 23, 42, 8, 99, 64, 3]  # teacher-forced decode tokens


class Recorder:
    """Wraps a decoder's gather hook: per (step, layer) the attended rows and the resident blocks."""

    def __init__(self, decoder: SparseDecoder) -> None:
        self.decoder = decoder
        self.calls: list[dict] = []

    def gather(self, layer: int, q_rot: torch.Tensor, cache) -> tuple | None:
        picked = self.decoder.gather(layer, q_rot, cache)
        assert picked is not None  # no step here is dense
        positions = picked.positions
        tier = self.decoder.tier
        group = tier.group_of[layer]
        self.calls.append(
            {
                "step": len(self.decoder.records) - 1,
                "layer": layer,
                "length": cache.length,
                "attended": positions[positions != HIDDEN].tolist(),
                "mask": picked.bias,
                "mask_known": picked.mask_known,
                "group": group,
                "resident": set(tier.resident(group)),
                "hidden": (positions == HIDDEN).tolist(),
            }
        )
        return picked


def decode_with(policy: str, model, ids: list[int], **options) -> tuple[Recorder, Runtime]:
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    with capture_prefill_queries(cache) as queries:
        logits = runtime.prefill(cache, ids)
    decoder = SparseDecoder(make_policy(policy, **options), SparseConfig(**CONFIG), BLOCK, prefill=queries)
    recorder = Recorder(decoder)
    for _ in range(STEPS):
        logits = runtime.decode(cache, int(logits.argmax()), recorder)
    decoder.finish()
    return recorder, runtime


@pytest.fixture(scope="module")
def model_and_prompt(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    ids = torch.randint(3, len(tokenizer), (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(11))
    return model, ids.tolist()


@pytest.mark.parametrize("policy, options", MATRIX, ids=[f"{n}{o or ''}" for n, o in MATRIX])
def test_policy_attends_sink_window_and_budget_blocks_and_accounts_bytes(policy, options, model_and_prompt):
    model, ids = model_and_prompt
    recorder, runtime = decode_with(policy, model, ids, **options)
    decoder = recorder.decoder
    tier = decoder.tier
    layers = runtime.num_layers
    assert len(decoder.records) == STEPS and len(recorder.calls) == STEPS * layers

    copies = 0
    resident_before: dict[int, set[int]] = {}
    for call in recorder.calls:
        record = decoder.records[call["step"]]
        group_layers = tier.layer_groups[call["group"]]
        selected = record.selected[call["group"]]  # one choice per group and step, in layer order
        length = call["length"]
        window_block = (length - CONFIG["window_tokens"]) // BLOCK
        budget = Budget(CONFIG["kv_budget"]).blocks(length, BLOCK)
        assert len(selected) == budget, (call, selected)
        assert all(1 <= b < window_block for b in selected)  # candidates only
        expected = set(range(BLOCK)) | set(range(window_block * BLOCK, length))
        expected |= {b * BLOCK + i for b in selected for i in range(BLOCK)}
        assert sorted(call["attended"]) == sorted(expected), (
            policy,
            call["step"],
            call["layer"],
        )  # once each
        # the mask handed over with the rows (the runtime applies it as is) hides exactly the hidden rows
        assert call["mask_known"]
        hidden = call["hidden"]
        assert call["mask"].isinf()[0].tolist() == hidden if call["mask"] is not None else not any(hidden)

        group = call["group"]
        if call["layer"] == group_layers[0]:  # a group's residency changes at its first layer only
            before = resident_before.get(group, set())
            resident = call["resident"]
            assert set(selected) <= resident and resident <= before | set(selected)
            assert len(resident) <= tier.slots
            copies += len(set(selected) - before) * len(group_layers)
            resident_before[group] = resident

    kvh, head_dim = model.config.num_key_value_heads, model.config.head_dim
    layer_block_bytes = 2 * kvh * BLOCK * head_dim * 4
    stats = decoder.stats()
    assert stats["bytes_loaded"] == copies * layer_block_bytes
    pairs = sum(len(r) * len(tier.layer_groups[g]) for g, r in resident_before.items())
    assert stats["resident_kv_bytes"] == pairs * layer_block_bytes
    budgets = [Budget(CONFIG["kv_budget"]).blocks(r.context_tokens, BLOCK) for r in decoder.records]
    assert stats["blocks_selected_per_step"] == pytest.approx(sum(budgets) / len(budgets))


@pytest.mark.parametrize("policy", ["keykey", "quest", "streaming", "h2o"])
def test_window_layers_only_reach_blocks_inside_their_window(policy, make_tiny_engine, tokenizer):
    """Gemma 3 with sliding-window layers only (window 8 <= the decoder's 32-token window): sparse decode
    at a 5% budget gives the dense logits at every step (window layers attend to their window and never
    select); with a global layer among them, that layer selects blocks far outside the window and the
    same budget does not give the dense logits."""

    def logits_of(
        layer_types: list[str], sparse: str | None
    ) -> tuple[list[torch.Tensor], SparseDecoder | None]:
        model = tiny_hf_model("gemma3_text", len(tokenizer), layer_types=layer_types)
        engine = make_tiny_engine("gemma3_text", hf_model=model)
        request = GenerateRequest(
            prompt="The committee met on Tuesday. " * 20, max_new_tokens=9, reuse="none", store_prompt=False,
            stop_at_eos=False,
        )  # fmt: skip
        seq = engine.fork(engine.prefill(request, capture_queries=True), sparse=sparse, kv_budget=0.05)
        out = [engine.decode_step(seq, feed=token) for token in FED]
        return out, seq.sparse

    windowed = ["sliding_attention", "sliding_attention"]
    dense, _ = logits_of(windowed, None)
    sparse, decoder = logits_of(windowed, policy)
    assert decoder.records and all(r.selected == [] for r in decoder.records)  # no layer selects
    torch.testing.assert_close(torch.stack(sparse), torch.stack(dense), atol=1e-5, rtol=0)
    mixed = ["sliding_attention", "full_attention"]
    mixed_sparse, mixed_decoder = logits_of(mixed, policy)
    far = mixed_decoder.records[-1].context_tokens - 32
    assert all(r.selected and r.selected[0] for r in mixed_decoder.records)
    assert any(b * 4 < far for r in mixed_decoder.records for sel in r.selected for b in sel)
    assert not torch.allclose(torch.stack(mixed_sparse), torch.stack(logits_of(mixed, None)[0]))
