"""Recompute passes pad their projections' rows to a few bucketed counts.

Injected: a selective recompute of 150 rows on a tiny llama in bf16 (packed oneDNN projections) whose
selector keeps 130 rows after layer 0 (row counts a request may never have used before), and the same
recompute with the padding turned off.

Must happen: every projection of the recompute sees a row count that is a multiple of ``ROW_BUCKET`` (or at
most one bucket), so the matmul kernels oneDNN builds per row count come from a small set; the logits
equal the unpadded recompute's within what the kernels' different blocking may leave
(:mod:`tests.tolerances`); a plain prefill (no selector) is not padded.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.models import runtime as runtime_module
from semkv.models.linear import prepacks
from semkv.models.runtime import ROW_BUCKET
from tests.conftest import tiny_hf_model
from tests.tolerances import config_atol

pytestmark = pytest.mark.skipif(
    not prepacks(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN does not pack bf16 weights"
)


class Shrinking:
    """Keeps the last ``keep[layer]`` of the active rows at each layer (the last row always kept)."""

    compares_cached = False

    def __init__(self, keep: list[int]) -> None:
        self.keep = keep

    def select(self, layer, active, fresh_k, fresh_v, cached_k, cached_v, inputs):
        count = min(self.keep[layer], active.numel())
        return torch.arange(active.numel() - count, active.numel(), device=active.device)


def _recompute(runtime: Runtime, prompt: list[int], selector) -> torch.Tensor:
    cache = runtime.new_cache(len(prompt))
    runtime.prefill(cache, prompt)  # rows hold KV; the recompute rewrites them
    return runtime.forward_rows(cache, 0, selector)


def test_recompute_rows_are_padded_to_buckets(tokenizer, monkeypatch):
    model = tiny_hf_model("llama", len(tokenizer), initializer_range=0.1)
    runtime = Runtime(adapter_for(model.config.model_type)(model), torch.bfloat16, torch.bfloat16)
    prompt = torch.randint(3, len(tokenizer), (150,), generator=torch.Generator().manual_seed(0)).tolist()
    seen: list[int] = []  # rows entering each layer's projections: q/k/v, then output + MLP
    qkv, finish = runtime.adapter.qkv, runtime.adapter.finish_layer

    def counting_qkv(layer, hidden):
        seen.append(hidden.shape[0])
        return qkv(layer, hidden)

    def counting_finish(layer, hidden, out):
        seen.append(out.shape[0])
        return finish(layer, hidden, out)

    monkeypatch.setattr(runtime.adapter, "qkv", counting_qkv)
    monkeypatch.setattr(runtime.adapter, "finish_layer", counting_finish)
    # layer 0: 150 rows in, 130 on; layer 1: 130 in (its output needs the last row only)
    keep = Shrinking([130, 101])
    padded = _recompute(runtime, prompt, keep)
    assert seen[-4:] == [160, 160, 160, 1], seen
    assert all(rows % ROW_BUCKET == 0 or rows <= ROW_BUCKET for rows in seen[-4:])
    seen.clear()
    cache = runtime.new_cache(len(prompt))
    runtime.prefill(cache, prompt)
    assert seen == [150, 150, 150, 1]  # a plain prefill keeps its rows (the last layer: the last row)

    monkeypatch.setattr(runtime_module, "_padded_rows", lambda x, bucket: x)
    seen.clear()
    plain = _recompute(runtime, prompt, keep)
    assert seen[-4:] == [150, 130, 130, 1]
    atol = config_atol(plain.float(), model.config, torch.bfloat16, len(prompt))
    torch.testing.assert_close(padded.float(), plain.float(), atol=atol, rtol=0)
