"""Token SimHash signatures and the persistent reference index (synthetic signatures, no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from semkv.reuse.lsh import (
    IndexConfig,
    MinHasher,
    PromptIndex,
    SimHashConfig,
    TokenHasher,
    bit_agreement,
    pack_bits,
    unpack_bits,
)


def _hasher(position_weight: float = 0.5, seed: int = 0, dim: int = 32) -> TokenHasher:
    return TokenHasher(SimHashConfig(bits=16, tables=8, position_weight=position_weight, seed=seed), dim)


def test_pack_unpack_roundtrip():
    bits = torch.rand(50, 4 * 13, generator=torch.Generator().manual_seed(1)) > 0.5
    packed = pack_bits(bits, 13)
    assert packed.shape == (50, 4) and packed.dtype == torch.int64
    assert torch.equal(unpack_bits(packed, 13), bits)


def test_bit_agreement_on_hand_made_bits():
    a = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    b = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert bit_agreement(a, b).tolist() == [[1.0, 0.0], [0.5, 0.5]]


def test_simhash_is_seeded_and_tracks_angle():
    emb = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.zeros(3, dtype=torch.long)
    h1, h2, other = _hasher(seed=5), _hasher(seed=5), _hasher(seed=6)
    assert torch.equal(h1.bits(emb, pos), h2.bits(emb, pos))
    assert not torch.equal(h1.bits(emb, pos), other.bits(emb, pos))
    blind = _hasher(position_weight=0.0)
    near = emb[0] + 0.05 * emb[1]
    bits = blind.bits(torch.stack([emb[0], near, -emb[0]]), pos)
    agree = bit_agreement(bits[:1], bits)[0]
    assert agree[1] > 0.85 and agree[2] == 0.0  # near vector agrees, opposite vector disagrees
    # SimHash: P[bit equal] = 1 - angle / pi, angle of the combined (embedding ; position) vectors
    vecs = h1.vectors(emb, pos)
    cos = torch.nn.functional.cosine_similarity(vecs[:1], vecs[1:])
    expected = 1 - torch.arccos(cos) / torch.pi
    assert torch.allclose(bit_agreement(h1.bits(emb, pos)[:1], h1.bits(emb, pos)[1:])[0], expected, atol=0.15)


def test_positional_component_prefers_nearby_positions():
    emb = torch.randn(1, 32, generator=torch.Generator().manual_seed(2)).repeat(4, 1)
    positions = torch.tensor([100, 104, 1500, 6000])
    with_pos = _hasher(position_weight=0.8).bits(emb, positions)
    agree = bit_agreement(with_pos[:1], with_pos)[0]
    assert agree[1] > agree[2] > agree[3]
    blind = _hasher(position_weight=0.0).bits(emb, positions)
    assert bit_agreement(blind[:1], blind)[0].tolist() == [1.0] * 4


def test_minhash_estimates_jaccard():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50_000, 2000).tolist()
    edited = list(base)
    for i in rng.choice(len(base), 400, replace=False):  # 20% of tokens changed
        edited[i] = int(rng.integers(50_000, 60_000))
    hasher = MinHasher(IndexConfig(num_hashes=256, bands=64))
    a, b = set(hasher.shingles(base).tolist()), set(hasher.shingles(edited).tolist())
    true = len(a & b) / len(a | b)
    estimate = float((hasher.signature(base) == hasher.signature(edited)).mean())
    assert abs(estimate - true) < 0.08


def _synthetic_prompts(count: int, length: int = 300, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 49_152, length).tolist() for _ in range(count)]


def test_index_finds_the_edited_prompt_among_many(tmp_path):
    prompts = _synthetic_prompts(2000)
    index = PromptIndex(IndexConfig())
    for i, p in enumerate(prompts):
        index.add(f"{i:064x}", p)
    target = list(prompts[1234])
    target[:20] = range(60_000, 60_020)  # a changed instruction
    hits = index.query(index.signature(target), top=3)
    assert hits and hits[0].key == f"{1234:064x}" and hits[0].similarity > 0.7
    assert hits[0].num_tokens == 300
    assert index.query(index.signature(_synthetic_prompts(1, seed=99)[0]), min_similarity=0.2) == []
    assert index.remove(f"{1234:064x}") and f"{1234:064x}" not in index
    assert all(h.key != f"{1234:064x}" for h in index.query(index.signature(target), top=3))
    assert len(index) == 1999


def test_index_persists_through_journal_and_snapshot(tmp_path):
    prompts = _synthetic_prompts(40, seed=3)
    config = IndexConfig(compact_every=16)
    index = PromptIndex(config, tmp_path)
    for i, p in enumerate(prompts):
        index.add(f"{i:064x}", p)
    index.remove(f"{7:064x}")
    assert list(tmp_path.glob("snapshot*.npz"))  # compaction happened
    reopened = PromptIndex(config, tmp_path)
    assert len(reopened) == 39 and f"{7:064x}" not in reopened
    for i in (0, 20, 39):
        assert reopened.query(reopened.signature(prompts[i]))[0].key == f"{i:064x}"


def test_index_ignores_a_torn_journal_line(tmp_path):
    """A writer killed mid-append leaves half a line: it is ignored, earlier records survive."""
    prompts = _synthetic_prompts(3, seed=4)
    index = PromptIndex(IndexConfig(), tmp_path)
    for i, p in enumerate(prompts):
        index.add(f"{i:064x}", p)
    journal = tmp_path / PromptIndex.JOURNAL
    journal.write_text(journal.read_text()[:-40])  # tear the last record
    reopened = PromptIndex(IndexConfig(), tmp_path)
    assert len(reopened) == 2 and reopened.query(reopened.signature(prompts[1]))[0].key == f"{1:064x}"


def test_index_built_with_other_settings_starts_empty(tmp_path):
    index = PromptIndex(IndexConfig(), tmp_path)
    index.add("a" * 64, list(range(100)))
    index.flush()
    assert len(PromptIndex(IndexConfig(), tmp_path)) == 1
    assert len(PromptIndex(IndexConfig(num_hashes=32, bands=16), tmp_path)) == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(bits=0), "bits must be in"),
        (dict(bits=63), "bits must be in"),
        (dict(position_features=3), "position_features must be even"),
        (dict(tables=0), r"tables must be in \[1, 64\]"),
        (dict(tables=65), r"tables must be in \[1, 64\]"),  # the hyperplanes grow with tables: bounded
    ],
)
def test_simhash_config_validation(bad, message):
    with pytest.raises(ValueError, match=message):
        SimHashConfig(**bad)


def test_index_config_validation():
    with pytest.raises(ValueError, match=r"bands \(7\) must divide num_hashes \(64\)"):
        IndexConfig(num_hashes=64, bands=7)
