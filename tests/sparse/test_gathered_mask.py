"""The sparse decoder's mask, built once per step, gives the same attention as one built per layer.

Injected: a tiny Llama (2 layers) run in bfloat16 on CPU (the compute path where the runtime takes the
decoder's mask as is, :func:`semkv.models.kernels.decode_products`), a 200-token prompt, kv_budget 0.1,
block size 4, 12 greedy decode steps, every sparse policy. A second run of the same policy gets the same
gathered rows with the mask taken away (plain keys, values, positions), so the runtime builds the mask
from the positions at every layer, as it did before the decoder handed one over.
Must happen: both runs select the same blocks and produce bit-identical logits at every step, and the
fast run's rows come with a mask (the path under test is taken).
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.sparse import POLICIES, SparseConfig, SparseDecoder, make_policy
from semkv.sparse.index import capture_prefill_queries
from tests.conftest import tiny_hf_model

BLOCK = 4
STEPS = 12
CONFIG = dict(kv_budget=0.1, sink_blocks=1, window_tokens=8)
SPARSE_POLICIES = sorted(set(POLICIES) - {"dense"})


class WithoutMask:
    """Hands the runtime the decoder's rows as a plain (keys, values, positions) triple."""

    def __init__(self, decoder: SparseDecoder) -> None:
        self.decoder = decoder

    def gather(self, layer: int, q_rot: torch.Tensor, cache) -> tuple | None:
        picked = self.decoder.gather(layer, q_rot, cache)
        return None if picked is None else (picked.keys, picked.values, picked.positions)


class Spy:
    """Counts the layers whose rows came with a known mask."""

    def __init__(self, decoder: SparseDecoder) -> None:
        self.decoder = decoder
        self.masked = 0

    def gather(self, layer: int, q_rot: torch.Tensor, cache) -> tuple | None:
        picked = self.decoder.gather(layer, q_rot, cache)
        self.masked += int(picked is not None and picked.mask_known and picked.bias is not None)
        return picked


def run(
    policy: str, model, ids: list[int], strip_mask: bool
) -> tuple[list[torch.Tensor], SparseDecoder, int]:
    runtime = Runtime(adapter_for("llama")(model), torch.float32, torch.bfloat16)
    cache = runtime.new_cache(len(ids) + STEPS + 1)
    with capture_prefill_queries(cache) as queries:
        logits = runtime.prefill(cache, ids)
    decoder = SparseDecoder(make_policy(policy), SparseConfig(**CONFIG), BLOCK, prefill=queries)
    gatherer = WithoutMask(decoder) if strip_mask else Spy(decoder)
    out = []
    for _ in range(STEPS):
        logits = runtime.decode(cache, int(logits.argmax()), gatherer)
        out.append(logits)
    return out, decoder, getattr(gatherer, "masked", 0)


@pytest.fixture(scope="module")
def model_and_prompt(tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    ids = torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(5))
    return model, ids.tolist()


@pytest.mark.parametrize("policy", SPARSE_POLICIES)
def test_mask_built_once_per_step_matches_the_per_layer_mask_bit_for_bit(policy, model_and_prompt):
    model, ids = model_and_prompt
    fast, fast_decoder, masked = run(policy, model, ids, strip_mask=False)
    slow, slow_decoder, _ = run(policy, model, ids, strip_mask=True)
    assert masked > 0  # the decoder's mask reached the runtime
    assert [r.selected for r in fast_decoder.records] == [r.selected for r in slow_decoder.records]
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(a, b), (policy, step)
