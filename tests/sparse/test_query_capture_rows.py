"""A prefill's query capture (``capture_prefill_queries``), which the probe and SnapKV/H2O decode from.

Injected: a tiny model's 150-token prefill (llama and Gemma 3 families, float32 and bfloat16 compute)
under a capture of the last 8 rows and every 16th from the end, with a second observer beside it that
rotates every row the forward computed; ``rotate_queries`` as the observed queries see it, wrapped to
count the rows it rotates.
Must happen: at every layer the captured queries are exactly (bit for bit, float32) the kept rows of
every row's rotation, rounded to the compute dtype as the attention used them, with their positions;
and the capture rotates only the rows it keeps (before, every prompt row was rotated at every layer for
the observer, a visible share of a long prompt's first token under ``sparse="auto"``: docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch

import semkv.models.cache as cache_module
from semkv.models import Runtime, adapter_for
from semkv.models.cache import ObservedQueries
from semkv.sparse.index import capture_prefill_queries, captured_offsets
from tests.conftest import tiny_hf_model

PROMPT_TOKENS, WINDOW, STRIDE = 150, 8, 16


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_capture_keeps_the_rotated_queries_the_attention_used(family, compute_dtype, tokenizer, monkeypatch):
    runtime = Runtime(
        adapter_for(family)(tiny_hf_model(family, len(tokenizer))), torch.float32, compute_dtype
    )
    ids = torch.randint(0, len(tokenizer), (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3))
    cache = runtime.new_cache(PROMPT_TOKENS + 1)
    every_row: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rotated_rows: list[int] = []
    rotate = cache_module.rotate_queries

    def counting_rotate(q, cos, sin, dtype):
        rotated_rows.append(q.shape[1])
        return rotate(q, cos, sin, dtype)

    monkeypatch.setattr(cache_module, "rotate_queries", counting_rotate)
    with capture_prefill_queries(cache, window=WINDOW, stride=STRIDE) as captured:
        record = cache.query_observer

        def both(layer: int, queries: ObservedQueries) -> None:
            record(layer, queries)
            every_row[layer] = (queries.rotated(), queries.positions.clone())

        cache.query_observer = both
        runtime.prefill(cache, ids.tolist())
    offsets = captured_offsets(PROMPT_TOKENS, WINDOW, STRIDE)
    assert sorted(captured.q) == list(range(runtime.num_layers))
    for layer, (rotated, positions) in every_row.items():
        assert rotated.dtype == compute_dtype
        assert torch.equal(captured.q[layer], rotated[:, offsets].float())
        assert torch.equal(captured.positions[layer], positions[offsets])
    # per layer: the capture's kept rows, then the second observer's every row
    assert rotated_rows == [offsets.numel(), PROMPT_TOKENS] * runtime.num_layers
