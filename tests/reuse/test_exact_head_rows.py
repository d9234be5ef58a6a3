"""The rows before the first chunk keep the KV the query probe computed for them.

Injected: a query blend (ratio 0.3) over stored chunks with no stored prefix, so the chat template's head
(the rows before the first chunk) is forced rows. Must hold: the recompute's forward runs none of them (the
probe computed their final KV: they attend only to each other), their KV at every layer is full prefill's,
and they still count among the blend's recomputed rows.
"""

from __future__ import annotations

import pytest
import torch

import semkv.reuse.blend as blend_module
from tests.conftest import TINY_FAMILIES
from tests.reuse.test_blend import DOCS, _blend_seq, _engine, _full_seq


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_head_rows_keep_the_probe_kv(family, make_tiny_engine, tokenizer, monkeypatch):
    engine = _engine(make_tiny_engine, tokenizer, family)
    engine.add_chunks(DOCS)
    calls: list[tuple[bool, torch.Tensor]] = []
    original = blend_module.forward_fixed_rows

    def spy(runtime, cache, start, rows, *args, **kwargs):
        calls.append((kwargs.get("probe") is not None, rows.clone()))
        return original(runtime, cache, start, rows, *args, **kwargs)

    monkeypatch.setattr(blend_module, "forward_fixed_rows", spy)
    blend = _blend_seq(engine, DOCS, recompute_ratio=0.3, selector="query")
    full = _full_seq(engine, DOCS)
    head = next(start for seg, start, _ in blend.layout.spans() if seg.kind == "chunk")
    assert head > 1 and blend.outcome.info["prefix_tokens"] == 0
    probed = [rows.tolist() for is_probe, rows in calls if is_probe]
    recomputed = [rows.tolist() for is_probe, rows in calls if not is_probe]
    assert len(probed) == 1 and len(recomputed) == 1
    assert set(range(head)) <= set(probed[0])
    assert not set(range(head)) & set(recomputed[0])
    for layer in range(engine.num_layers):
        for name in ("k_pre", "k_rot", "v"):
            torch.testing.assert_close(
                getattr(blend.cache, name)[layer][:, :head],
                getattr(full.cache, name)[layer][:, :head],
                atol=1e-5,
                rtol=1e-5,
                msg=f"{name} of layer {layer}",
            )
    assert set(range(head)) <= set(blend.outcome.info["recomputed_rows"])
