"""SnapKV / H2O score blocks with the prompt queries captured at prefill: those must be the queries the
model really attends with. On Gemma 3 that is *after* q_norm and RoPE — a hook on ``q_proj`` (how the
capture used to work) sees the query before q_norm. Checked against HF's own modules and RoPE."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

from semkv.request import GenerateRequest

PROMPT = "The lighthouse keeper counted the ships that passed the cape every night of the long winter."


def hf_queries(engine, token_ids: list[int], q_norm: bool = True) -> dict[int, torch.Tensor]:
    """layer -> rotated queries [nh, T, d] computed with HF's Gemma 3 modules on the full prompt
    (``q_norm=False``: what a hook on q_proj sees, rotated)."""
    model = engine.hf_model
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # input of layer l = states[l]
        out = {}
        for layer, block in enumerate(model.model.layers):
            attn = block.self_attn
            x = block.input_layernorm(states[layer])
            q = attn.q_proj(x).view(1, len(token_ids), -1, attn.head_dim)
            q = (attn.q_norm(q) if q_norm else q).transpose(1, 2)
            positions = torch.arange(len(token_ids)).unsqueeze(0)
            cos, sin = model.model.rotary_emb(x, positions, model.config.layer_types[layer])
            q_rot, _ = apply_rotary_pos_emb(q, q, cos, sin)
            out[layer] = q_rot[0]
    return out


@pytest.mark.parametrize("family", ["gemma3_text", "llama"])
def test_captured_queries_are_the_attended_queries(make_tiny_engine, family):
    engine = make_tiny_engine(family)
    request = GenerateRequest(prompt=PROMPT, max_new_tokens=1, reuse="none", store_prompt=False)
    seq = engine.prefill(request, capture_queries=True)
    captured = seq.prefill_queries
    assert captured is not None and set(captured.q) == set(range(engine.num_layers))
    if family != "gemma3_text":
        return
    reference = hf_queries(engine, seq.layout.token_ids)
    before_norm = hf_queries(engine, seq.layout.token_ids, q_norm=False)
    for layer, q in captured.q.items():
        rows = captured.positions[layer]
        torch.testing.assert_close(q, reference[layer][:, rows], atol=1e-4, rtol=1e-4)
        # what a q_proj hook records (before q_norm) is far from the attended query
        assert (q - before_norm[layer][:, rows]).abs().max() > 0.1


def test_snapkv_and_h2o_run_on_captured_gemma_queries(make_tiny_engine):
    """The policies that read the captured queries decode on Gemma 3 (window and global layers)."""
    engine = make_tiny_engine("gemma3_text")
    for policy in ("snapkv", "h2o"):
        g = engine.generate(
            prompt=PROMPT * 3,
            max_new_tokens=4,
            stop_at_eos=False,
            sparse=policy,
            kv_budget=0.3,
            store_prompt=False,
        )
        assert len(g.token_ids) == 4 and g.stats["sparse_policy"] == policy
