"""Key-Key's level summaries are built once per new block and reused between steps.

Injected: a Key-Key decode on a tiny model long enough for new blocks to complete mid-decode,
with a reference that rebuilds every summary from the cache at every step. Must happen: the
cached scores equal the reference at every step (so a completed block or a moved window
always invalidates the cache), and selection used the cached path.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models import Runtime, adapter_for
from semkv.sparse import SparseConfig, SparseDecoder, hierarchical_scores
from semkv.sparse.base import StepView
from semkv.sparse.keykey import KeyKeyPolicy
from tests.conftest import tiny_hf_model

BLOCK = 4


class CheckedKeyKey(KeyKeyPolicy):
    """Key-Key that also recomputes every step's scores from scratch and records both."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.blocks_seen: set[int] = set()

    def score(self, view: StepView) -> torch.Tensor:
        cached = super().score(view)
        means = view.index.key_means()
        pooled = self._pool(means, self._head_weights(view))
        centre = pooled.mean(dim=-2) if self.center else torch.zeros(pooled.shape[-1])
        pages = pooled[..., view.candidate_span(), :] - centre.unsqueeze(-2)
        anchor = self._pool(self._anchor_means(view), self._head_weights(view)).squeeze(-2) - centre
        keep_g, keep_c = self._keep_counts(view, pages.shape[-2])
        reference, _, _ = hierarchical_scores(
            pages, anchor, self.pages_per_chunk, self.chunks_per_grid, keep_g, keep_c
        )
        self.pairs.append((cached, reference))
        self.blocks_seen.add(view.index.num_complete)
        return cached


@pytest.mark.parametrize("center", [True, False])
def test_cached_summaries_match_a_rebuild_every_step(tokenizer, center):
    model = tiny_hf_model("llama", len(tokenizer))
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    ids = torch.randint(0, len(tokenizer), (120,), generator=torch.Generator().manual_seed(7)).tolist()
    policy = CheckedKeyKey(center=center)
    decoder = SparseDecoder(policy, SparseConfig(kv_budget=0.2, window_tokens=6, reselect_every=1), BLOCK)
    cache = runtime.new_cache(len(ids) + 14)
    logits = runtime.prefill(cache, ids)
    for _ in range(12):
        logits = runtime.decode(cache, int(logits.argmax()), decoder)
    assert len(policy.pairs) == 12
    assert len(policy.blocks_seen) >= 3, "blocks must complete during the decode"
    for cached, reference in policy.pairs:
        assert torch.equal(torch.isfinite(cached), torch.isfinite(reference))
        torch.testing.assert_close(cached[torch.isfinite(cached)], reference[torch.isfinite(reference)])


def test_block_summaries_follow_a_cache_that_grows(tokenizer):
    """Injected: a cache created small that grows (reserve by doubling) after summaries were taken.
    Must happen: the summaries of every block, old and new, equal a direct computation from the cache."""
    from semkv.sparse.index import BlockIndex

    model = tiny_hf_model("llama", len(tokenizer))
    runtime = Runtime(adapter_for("llama")(model), torch.float32)
    ids = torch.randint(0, len(tokenizer), (200,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = runtime.new_cache(24)
    runtime.prefill(cache, ids[:24])
    index = BlockIndex(cache, BLOCK)
    index.add_blocks()
    index.key_means(), index.key_bounds()
    runtime.prefill(cache, ids[24:])
    assert cache.capacity >= 200
    index.add_blocks()
    keys = torch.stack([k[:, :200] for k in cache.k_pre]).float()  # [L, kvh, 200, d]
    blocks = keys.view(*keys.shape[:2], 200 // BLOCK, BLOCK, keys.shape[-1])
    torch.testing.assert_close(index.key_means(), blocks.mean(dim=3))
    rotated = torch.stack([k[:, :200] for k in cache.k_rot]).float()
    rotated = rotated.view(*blocks.shape)
    mins, maxs = index.key_bounds()
    torch.testing.assert_close(mins, rotated.amin(dim=3))
    torch.testing.assert_close(maxs, rotated.amax(dim=3))
