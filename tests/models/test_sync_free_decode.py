"""Decode attention with masks built once per step (the path a GPU takes) against the CPU kernels.

Injected: ``Runtime.sync_free_decode`` switched on on the CPU (it is on by default off the CPU), so every
dense per-sequence decode step attends through torch's fused kernel with an additive mask built from
positions before the layer loop, on a model with sliding-window layers narrower than the context
(gemma3) and on plain causal models, with caches whose rows are out of position order. Must happen: the
logits equal the CPU kernels' within fp32 rounding of a reordered softmax sum, greedy tokens identical,
and the mask hides exactly what the position rule hides (a key after the query, or outside its window).
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from tests.conftest import tiny_hf_model

STEPS = 8


def _runtime(family: str, vocab: int, **overrides) -> Runtime:
    model = tiny_hf_model(family, vocab, initializer_range=0.1, **overrides)
    return Runtime(adapter_for(model.config.model_type)(model), torch.float32, torch.float32)


def _decode(runtime: Runtime, prompt: list[int], shuffled: bool) -> tuple[list[int], list[torch.Tensor]]:
    cache = runtime.new_cache(len(prompt) + STEPS + 1)
    positions = torch.arange(len(prompt))
    order = torch.randperm(len(prompt), generator=torch.Generator().manual_seed(1)) if shuffled else positions
    cache.append_rows(positions[order], [prompt[i] for i in order.tolist()])
    logits = runtime.forward_rows(cache, 0)
    tokens, seen = [], []
    for _ in range(STEPS):
        token = int(torch.argmax(logits))
        tokens.append(token)
        logits = runtime.decode(cache, token)
        seen.append(logits)
    return tokens, seen


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("shuffled", [False, True])
def test_masks_built_once_per_step_give_the_kernels_logits(family: str, shuffled: bool) -> None:
    vocab = 97
    overrides = {"sliding_window": 8} if family == "gemma3_text" else {}
    runtime = _runtime(family, vocab, **overrides)
    prompt = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    assert not runtime.sync_free_decode  # off on the CPU by default
    expected_tokens, expected = _decode(runtime, prompt, shuffled)
    runtime.sync_free_decode = True
    tokens, got = _decode(runtime, prompt, shuffled)
    assert tokens == expected_tokens
    # fp32 softmax sums in another order: a few ulps of the logits' scale per layer
    eps = torch.finfo(torch.float32).eps
    for a, b in zip(got, expected, strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=64 * eps * max(scale, 1.0))
