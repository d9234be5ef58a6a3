"""Share's ``layer0_window``: layer 0 recomputes only the rows near a change, not every row.

Injected: hand-made alignments (a substitution, a moved run, an exact prefix before the first row) for
:func:`near_breaks`; end to end on a 4-layer tiny llama (KV float32), a target whose document has one
sentence replaced in its middle, served with ``layer0_window`` 8, with 0 and with the default (32).
Must happen: exactly the rows within the window after each break (a forced row, or a row whose reference
row does not follow the previous one's) are computed at layer 0; every other row holds the reference's KV
of its matched token at every layer (nothing of it recomputed), and the stats report the smaller layer-0
row count; a window of 0 still computes every row at layer 0 (the paper's method), the default fewer; a
negative window is a clear error.
"""

from __future__ import annotations

import pytest
import torch

from semkv.evaluation.essays import haystack
from semkv.request import GenerateRequest
from semkv.reuse.options import ShareConfig
from semkv.reuse.share import ALIGNED, near_breaks
from tests.conftest import tiny_hf_model


def test_near_breaks_takes_the_rows_after_each_break() -> None:
    # rows 0-3 follow the exact prefix (reference rows 5..8 after row 4), row 4 jumps, row 10 is unmatched
    source = torch.tensor([5, 6, 7, 8, 20, 21, 22, 23, 24, 25, -1, 30, 31, 32, 33, 34, 35, 36])
    forced = source < 0
    forced[-1] = True
    got = near_breaks(source, forced, 3, previous=4)
    assert got is not None and got.tolist() == [4, 5, 6, 10, 11, 12, 13, 17]
    # without an exact prefix before it, the first row is a break too
    got = near_breaks(source, forced, 3)
    assert got is not None and got.tolist() == [0, 1, 2, 4, 5, 6, 10, 11, 12, 13, 17]
    got = near_breaks(source, forced, 1, previous=4)
    assert got is not None and got.tolist() == [4, 10, 11, 17]
    assert near_breaks(source, forced, 0) is None


def test_a_negative_window_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"layer0_window must be in \[0, "):
        ShareConfig(layer0_window=-1)
    with pytest.raises(ValueError, match="layer0_window must be an int"):
        ShareConfig(layer0_window=2.5)


@pytest.fixture
def engine4(make_tiny_engine, tokenizer):
    return make_tiny_engine("llama", hf_model=tiny_hf_model("llama", len(tokenizer), num_hidden_layers=4))


def _edited(tokenizer) -> tuple[str, str]:
    sentences = haystack(tokenizer, 240, start_essay=2).split(". ")
    assert len(sentences) >= 5
    middle = len(sentences) // 2
    edited = [
        *sentences[:middle],
        "Purple kites rarely argue with the quiet harbour",
        *sentences[middle + 1 :],
    ]
    return "Summarise:\n\n" + ". ".join(sentences), "Summarise:\n\n" + ". ".join(edited)


def test_rows_far_from_a_change_keep_the_reference_kv_at_every_layer(engine4, tokenizer) -> None:
    reference, target = _edited(tokenizer)
    engine4.generate(prompt=reference, max_new_tokens=1)
    window = 8
    config = ShareConfig(layer0_window=window, first_ratio=0.0, min_ratio=0.0)
    seq = engine4.prefill(GenerateRequest(prompt=target, max_new_tokens=1, reuse="share", share=config))
    assert seq.plan.path == "share", seq.refusals
    match, ref, cache = seq.plan.match, seq.plan.reference, seq.cache
    n = len(seq.layout.token_ids)
    prefix = min(match.exact_prefix, n - 1)
    source = torch.from_numpy(match.source[prefix:])
    forced = (source < 0) | torch.from_numpy(match.kind[prefix:] != ALIGNED)
    forced[-config.recompute_last :] = True
    near = near_breaks(source, forced, window, prefix - 1)
    assert near is not None
    stats = engine4.finish(seq).stats
    assert stats["share_layer0_rows"] == near.numel() == stats["share_layer_rows"][0]
    assert near.numel() < (n - prefix) // 2  # one replaced sentence: most rows are far from it
    far = torch.ones(n - prefix, dtype=torch.bool)
    far[near] = False
    rows = far.nonzero().squeeze(1) + prefix
    assert rows.numel() > (n - prefix) // 2
    for layer in range(engine4.runtime.num_layers):
        want = source[far]
        assert torch.equal(cache.k_pre[layer][:, rows], ref.k[layer][:, want].to(cache.k_pre[layer].dtype))
        assert torch.equal(cache.v[layer][:, rows], ref.v[layer][:, want].to(cache.v[layer].dtype))


def test_window_0_computes_every_row_at_layer_0_and_the_default_fewer(engine4, tokenizer) -> None:
    reference, target = _edited(tokenizer)
    engine4.generate(prompt=reference, max_new_tokens=1)
    paper = engine4.generate(
        prompt=target, max_new_tokens=1, reuse="share", share=ShareConfig(layer0_window=0), store_prompt=False
    ).stats
    assert paper["path"] == "share"
    every = paper["prompt_tokens"] - paper["share_exact_prefix"]
    assert paper["share_layer0_rows"] == paper["share_layer_rows"][0] == every
    default = engine4.generate(prompt=target, max_new_tokens=1, reuse="share", store_prompt=False).stats
    assert ShareConfig().layer0_window == 32
    assert default["path"] == "share" and default["share_layer0_rows"] < every
