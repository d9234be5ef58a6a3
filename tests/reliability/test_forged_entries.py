"""Forged and poisoned entries: whoever can write the disk folder or Redis cannot steer the model.

Injected: an attacker who can write to the store but does not hold the deployment's store secret.
Keys, fingerprints and checksums are all computable from public data, so it replaces a prompt's
stored prefix blocks with well-formed entries — right key, token ids, fingerprint and checksums —
whose KV is poisoned (scaled by 50), unsigned or signed with a wrong secret; on the disk tier and on
a real ``redis-server``; the secret given in the config, or only in ``$SEMKV_STORE_SECRET`` (as
``semkv serve`` deployments are told to pass it). Then, on a deployment without a secret, entries whose KV has NaNs or the wrong
shape (checksums valid).

Must hold: without a secret the forged blocks are served (the control: the attack is real, the
output's first-token logits move); with the secret every forged entry is a miss — the answer equals
a cache-less run exactly, the tier counts it ``unauthenticated`` and removes it (quarantine on disk,
DEL in Redis), and the real entry is written back. Entries with NaNs or a wrong shape are refused
(``invalid``) and the answer equals a cache-less run; nothing raises.
"""

from __future__ import annotations

import pytest
import redis
import torch

from semkv.config import STORE_SECRET_ENV
from semkv.store.entry import KVEntry, decode, encode
from tests.reliability.reliability_helpers import (
    PROMPT,
    block_keys_of,
    engine_at,
)

SECRET = "deployment-secret-0123456789"


@pytest.fixture(scope="module")
def reference(model, tokenizer, tmp_path_factory):
    engine = engine_at(tmp_path_factory.mktemp("ref"), tokenizer, model, disk=False)
    return engine.generate(PROMPT, max_new_tokens=2, reuse="none", store_prompt=False)


def poisoned(entry: KVEntry, how: str = "scaled") -> KVEntry:
    k, v = entry.k.clone(), entry.v.clone()
    if how == "scaled":
        k, v = k * 50, v * 50
    elif how == "nan":
        k[0, 0, 0, 0] = float("nan")
    elif how == "shape":
        k, v = k[:, :, :, :-1].contiguous(), v[:, :, :, :-1].contiguous()
    return KVEntry(
        entry.key, entry.kind, entry.fingerprint, list(entry.token_ids), k, v, entry.block_size, entry.parent,
        dict(entry.extras), dict(entry.meta),
    )  # fmt: skip


def forge_disk(home, keys, signer: bytes | None, how: str = "scaled") -> None:
    for key in keys:
        path = home / "store" / key[:2] / f"{key}.skv"
        path.write_bytes(encode(poisoned(decode(path.read_bytes()), how), signer))


def check_reference(g, reference) -> None:
    assert g.token_ids == reference.token_ids
    torch.testing.assert_close(g.first_logits, reference.first_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("signer", [None, b"attacker-guess-0123456789"], ids=["unsigned", "wrong_secret"])
def test_forged_disk_entries_are_misses_with_the_secret(tmp_path, tokenizer, model, reference, signer):
    home = tmp_path / "home"
    engine_at(home, tokenizer, model, secret=SECRET).generate(PROMPT, max_new_tokens=2)
    keys = block_keys_of(engine_at(tmp_path / "probe", tokenizer, model, disk=False))
    forge_disk(home, keys, signer)

    victim = engine_at(home, tokenizer, model, secret=SECRET)
    g = victim.generate(PROMPT, max_new_tokens=2)
    check_reference(g, reference)
    disk = victim.store.tier("disk")
    assert g.stats["reused_tokens"] == 0 and disk.stats.unauthenticated >= 1
    assert (home / "store" / "quarantine").exists()
    again = engine_at(home, tokenizer, model, secret=SECRET).generate(PROMPT, max_new_tokens=2)
    assert again.stats["reused_tokens"] > 0  # the real entries were written back, signed
    check_reference(again, reference)


def test_the_secret_from_the_environment_is_used(tmp_path, tokenizer, model, reference, monkeypatch):
    """A store configured without a secret takes ``$SEMKV_STORE_SECRET``: the forgery is a miss."""
    monkeypatch.setenv(STORE_SECRET_ENV, SECRET)
    home = tmp_path / "home"
    engine_at(home, tokenizer, model).generate(PROMPT, max_new_tokens=2)
    keys = block_keys_of(engine_at(tmp_path / "probe", tokenizer, model, disk=False))
    forge_disk(home, keys, None)
    victim = engine_at(home, tokenizer, model)
    g = victim.generate(PROMPT, max_new_tokens=2)
    check_reference(g, reference)
    assert g.stats["reused_tokens"] == 0 and victim.store.tier("disk").stats.unauthenticated >= 1


def test_without_the_secret_the_forgery_is_served(tmp_path, tokenizer, model, reference):
    """The control: the same forgery on a deployment without a store secret steers the model."""
    home = tmp_path / "home"
    engine_at(home, tokenizer, model).generate(PROMPT, max_new_tokens=2)
    keys = block_keys_of(engine_at(tmp_path / "probe", tokenizer, model, disk=False))
    forge_disk(home, keys, None)
    g = engine_at(home, tokenizer, model).generate(PROMPT, max_new_tokens=2)
    assert g.stats["reused_tokens"] > 0
    assert not torch.allclose(g.first_logits, reference.first_logits, atol=1e-3)


def test_forged_redis_values_are_misses_with_the_secret(tmp_path, tokenizer, model, reference, redis_server):
    writer = engine_at(
        tmp_path / "a", tokenizer, model, disk=False, redis_url=redis_server.url, secret=SECRET
    )
    writer.generate(PROMPT, max_new_tokens=2)
    client = redis.Redis.from_url(redis_server.url)
    tier = writer.store.tier("redis")
    keys = block_keys_of(writer)
    for key in keys:
        real = decode(client.get(tier.redis_key(key)), SECRET.encode())
        client.set(tier.redis_key(key), encode(poisoned(real), None))
    victim = engine_at(
        tmp_path / "b", tokenizer, model, disk=False, redis_url=redis_server.url, secret=SECRET
    )
    g = victim.generate(PROMPT, max_new_tokens=2)
    check_reference(g, reference)
    redis_tier = victim.store.tier("redis")
    assert g.stats["reused_tokens"] == 0 and redis_tier.stats.unauthenticated >= 1
    assert decode(client.get(tier.redis_key(keys[0])), SECRET.encode()).key == keys[0]  # rewritten, signed


@pytest.mark.parametrize("how", ["nan", "shape"])
def test_unloadable_kv_is_refused(tmp_path, tokenizer, model, reference, how):
    home = tmp_path / "home"
    engine_at(home, tokenizer, model).generate(PROMPT, max_new_tokens=2)
    keys = block_keys_of(engine_at(tmp_path / "probe", tokenizer, model, disk=False))
    forge_disk(home, keys, None, how)
    victim = engine_at(home, tokenizer, model)
    g = victim.generate(PROMPT, max_new_tokens=2)
    check_reference(g, reference)
    assert g.stats["reused_tokens"] == 0 and victim.store.stats.invalid >= 1
