"""The derived tolerances of :mod:`tests.tolerances`: wide enough for any summation order, narrow enough
for a real error.

Injected: (1) float32 dot products summed in four orders (BLAS, pairwise, forward, backward) over
random inputs; (2) a causal mask that lets each query see one later key, and a tiny model's logits with the last token one position further (a gap
before it: RoPE sees other distances; shifting every position alike changes nothing), or one context token
changed. Must happen: (1) every pair of orders is within :func:`reduction_atol`; (2) each error is
further from the right result than :func:`attention_atol` / :func:`config_atol` allow, by a wide margin.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from tests.conftest import tiny_hf_model
from tests.tolerances import attention_atol, config_atol, reduction_atol


def _orders(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """x . y (float32) summed in four orders."""
    products = x * y
    forward = torch.zeros((), dtype=torch.float32)
    for p in products:
        forward = forward + p
    backward = torch.zeros((), dtype=torch.float32)
    for p in products.flip(0):
        backward = backward + p
    return [x @ y, products.sum(), forward, backward]


@pytest.mark.parametrize("k", [64, 1024, 4096])
def test_summation_orders_stay_within_the_reduction_bound(k):
    gen = torch.Generator().manual_seed(k)
    worst = 0.0
    for _ in range(20):
        x, y = torch.randn(k, generator=gen), torch.randn(k, generator=gen)
        bound = reduction_atol(k, float((x * y).abs().sum()))
        results = _orders(x, y)
        spread = float(max(results) - min(results))
        assert spread <= bound
        worst = max(worst, spread / bound)
    assert worst > 0.0  # the orders do differ: the check is not vacuous


def _last_logits(runtime: Runtime, tokens: list[int], gap: int = 0) -> torch.Tensor:
    """The last token's logits, ``gap`` positions after the one it should have."""
    positions = torch.arange(len(tokens))
    positions[-1] += gap
    return runtime.prefill(runtime.new_cache(len(tokens)), tokens, positions=positions)


def test_a_real_error_is_far_outside_the_model_bound(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer), initializer_range=0.1)
    runtime = Runtime(adapter_for("llama")(model), torch.float32, torch.float32)
    tokens = torch.randint(3, len(tokenizer), (24,), generator=torch.Generator().manual_seed(1)).tolist()
    right = _last_logits(runtime, tokens)
    atol = config_atol(right, model.config, torch.float32, context=len(tokens))
    shifted = _last_logits(runtime, tokens, gap=1)
    changed = _last_logits(runtime, [tokens[0] + 1, *tokens[1:]])
    for wrong in (shifted, changed):
        assert float((wrong - right).abs().max()) > 20 * atol


def _attention(q, k, v, visible):
    """Softmax attention of q [h, Tq, d] over k, v [h, Tk, d] where ``visible`` [Tq, Tk] allows."""
    scores = (q @ k.transpose(1, 2) * 0.25).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_a_mask_one_key_off_is_far_outside_the_attention_bound():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(4, 64, 16, generator=gen) for _ in range(3))
    pos = torch.arange(64)
    right = _attention(q, k, v, pos.unsqueeze(0) <= pos.unsqueeze(1))
    wrong = _attention(q, k, v, pos.unsqueeze(0) <= pos.unsqueeze(1) + 1)
    assert float((wrong - right)[:, :-1].abs().max()) > 20 * attention_atol(q, k, v, 0.25)
