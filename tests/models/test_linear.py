"""Projections with oneDNN-packed weights: the same bits as ``F.linear``, packed only where that runs.

Injected: weights in bf16 (packed on CPUs with oneDNN bf16 support), in fp32 (never packed), a packing
op that raises and one whose products are wrong (the projection must fall back to ``F.linear``).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from semkv.config import EngineConfig
from semkv.models import Runtime, adapter_for, linear
from semkv.models.adapters import LlamaFamilyAdapter
from semkv.models.linear import Projection, prepacks
from tests.conftest import tiny_hf_model

CPU = torch.device("cpu")
packs_bf16 = pytest.mark.skipif(not prepacks(CPU, torch.bfloat16), reason="no oneDNN bf16 on this CPU")


def _weights(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    return weight, (torch.randn(96, generator=gen).to(dtype) if bias else None)


@packs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_bf16_projection_gives_f_linear_bits(rows: int, bias: bool):
    weight, b = _weights(torch.bfloat16, bias)
    projection = Projection.make(weight, b)
    assert projection.packed is not None
    x = torch.randn(rows, 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(projection(x), F.linear(x, weight, b))


def test_float32_is_never_packed():
    weight, b = _weights(torch.float32, True)
    assert not prepacks(CPU, torch.float32)
    projection = Projection.make(weight, b)
    assert projection.packed is None
    x = torch.randn(5, 40)
    assert torch.equal(projection(x), F.linear(x, weight, b))


@packs_bf16
def test_a_failing_pack_falls_back_to_f_linear(monkeypatch, caplog):
    def broken(weight, batch_size):
        raise RuntimeError("injected: no reorder")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    weight, b = _weights(torch.bfloat16, False)
    with caplog.at_level(logging.WARNING, logger=linear.__name__):
        projection = Projection.make(weight, b)
    assert projection.packed is None and "could not pack" in caplog.text
    x = torch.randn(3, 40).bfloat16()
    assert torch.equal(projection(x), F.linear(x, weight))


@packs_bf16
def test_a_pack_with_wrong_products_is_not_used(monkeypatch, caplog):
    real = torch.ops.mkldnn._reorder_linear_weight

    def scrambled(weight, batch_size):
        return real(weight.flip(0), batch_size)  # the output rows in the wrong order

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", scrambled)
    weight, _ = _weights(torch.bfloat16, False)
    with caplog.at_level(logging.WARNING, logger=linear.__name__):
        assert Projection.make(weight).packed is None
    assert "differs" in caplog.text


@packs_bf16
def test_a_bf16_adapter_packs_every_matrix_and_the_head(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer)).to(torch.bfloat16)
    adapter = LlamaFamilyAdapter(model)
    for w in adapter.weights:
        assert all(p.packed is not None for p in (w.qkv, w.o, w.gate_up, w.down))
    assert adapter.head.packed is not None
    hidden = torch.randn(4, adapter.hidden_size)
    normed = F.rms_norm(hidden, (adapter.hidden_size,), *adapter.final_norm)
    assert torch.equal(adapter.logits(hidden), model.lm_head(normed.bfloat16()).float())


@packs_bf16
def test_pack_weights_false_keeps_plain_f_linear_through_the_runtimes_cast_copy(tokenizer):
    """Injected: an fp32 model handed to a bf16 runtime with ``pack_weights=False`` (the runtime builds a
    private cast copy and a new adapter). Must happen: no projection of the new adapter is packed."""
    model = tiny_hf_model("llama", len(tokenizer))
    runtime = Runtime(adapter_for("llama")(model, pack_weights=False), torch.float32, torch.bfloat16)
    assert runtime.adapter.pack_weights is False
    for w in runtime.adapter.weights:
        assert all(p.packed is None for p in (w.qkv, w.o, w.gate_up, w.down))
    assert runtime.adapter.head.packed is None
    packed = Runtime(adapter_for("llama")(model), torch.float32, torch.bfloat16)
    assert packed.adapter.weights[0].qkv.packed is not None


def test_engine_config_rejects_a_non_bool_pack_weights(tmp_path):
    with pytest.raises(ValueError, match="pack_weights"):
        EngineConfig(home=tmp_path, pack_weights="no")
