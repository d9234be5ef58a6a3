"""Our layer-wise runtime must reproduce the HF model: logits (fp32, within what two kernels' summation
orders may leave: :mod:`tests.tolerances`) and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from tests.conftest import TINY_FAMILIES, tiny_hf_model
from tests.tolerances import assert_close_across_kernels


def _runtime(model) -> Runtime:
    return Runtime(adapter_for(model.config.model_type)(model), torch.float32)


def _check_exact(model, ids: torch.Tensor, new_tokens: int = 32) -> None:
    runtime = _runtime(model)
    with torch.no_grad():
        reference = model(ids[None]).logits[0]
    cache = runtime.new_cache(len(ids) + new_tokens)
    logits = runtime.prefill(cache, ids.tolist())
    assert_close_across_kernels(logits, reference[-1], model.config, context=len(ids))
    # split prefill (a past) gives the same last logits
    split = runtime.new_cache(len(ids))
    runtime.prefill(split, ids[: len(ids) // 3].tolist())
    assert_close_across_kernels(
        runtime.prefill(split, ids[len(ids) // 3 :].tolist()), reference[-1], model.config, context=len(ids)
    )
    # greedy decode == HF generate
    expected = model.generate(
        ids[None], max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens, pad_token_id=0
    )[0, len(ids) :].tolist()
    ours = []
    for _ in range(new_tokens):
        token = int(logits.argmax())
        ours.append(token)
        logits = runtime.decode(cache, token)
    assert ours == expected


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_family_matches_hf(family, tokenizer):
    model = tiny_hf_model(family, len(tokenizer))
    ids = torch.randint(0, len(tokenizer), (97,), generator=torch.Generator().manual_seed(1))
    _check_exact(model, ids)


def test_sliding_window_matches_hf(tokenizer):
    """Mistral with a window shorter than the prompt: masks from positions honour the window."""
    model = tiny_hf_model("mistral", len(tokenizer), sliding_window=24)
    ids = torch.randint(0, len(tokenizer), (80,), generator=torch.Generator().manual_seed(2))
    _check_exact(model, ids, new_tokens=8)


@pytest.mark.real_model
def test_smollm2_matches_hf(smollm2):
    text = "The quick brown fox jumps over the lazy dog. " * 30
    ids = torch.tensor(smollm2.tokenizer(text)["input_ids"])
    _check_exact(smollm2.hf_model, ids)


@pytest.mark.parametrize("last", [10, 0, 19])
def test_scattered_queries_never_see_later_keys(tokenizer, last):
    """Attention masks come from positions, not row order: the 20 tokens are prefilled in ONE pass with
    their rows shuffled (each at its true position) and the row of position ``last`` placed last, so
    keys at later positions sit in earlier rows and are computed in the same pass. The logits of that
    row must be HF's at position ``last`` (an in-order causal mask over rows would let it see them)."""
    model = tiny_hf_model("llama", len(tokenizer))
    runtime = _runtime(model)
    ids = torch.randint(0, len(tokenizer), (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model(ids[None]).logits[0]
    others = [
        p for p in torch.randperm(20, generator=torch.Generator().manual_seed(last)).tolist() if p != last
    ]
    order = torch.tensor(others + [last])
    assert int(order[0]) > last or last == 19  # a later key is the very first row
    cache = runtime.new_cache(20)
    logits = runtime.prefill(cache, ids[order].tolist(), positions=order)
    assert_close_across_kernels(logits, reference[last], model.config, context=20)
    assert torch.equal(cache.positions[:20], order)  # the rows really are scattered
