"""A Redis that refuses writes still serves reads; values over the size cap are never sent.

Injected (a real ``redis-server``; engines with memory + Redis tiers, no disk): Redis holds a prompt's
blocks, then is set to ``maxmemory`` below its usage with ``noeviction`` — it answers every write with
``OOM command not allowed`` — while a fresh engine serves a new prompt (its writes refused) and then
the stored prompt. Separately, an engine whose Redis size cap (``redis_max_value_bytes``) is below
the size of one block entry.

Must hold: refused writes are counted (``refused``), never open the circuit (no outage, the tier stays
available), and the stored prompt is reused from Redis right after them, with output identical to a
cache-less run; over the cap nothing is sent (``oversize`` counted, no key written) and the request is
served from the local tiers.
"""

from __future__ import annotations

import pytest
import redis
import torch

from tests.reliability.reliability_helpers import (
    PROMPT,
    block_keys_of,
    engine_at,
)

OTHER = "A new prompt whose blocks Redis will refuse to store, because it is full."


def test_refused_writes_do_not_stop_reads(tmp_path, tokenizer, model, redis_server):
    reference = engine_at(tmp_path / "ref", tokenizer, model, disk=False).generate(
        PROMPT, max_new_tokens=2, reuse="none", store_prompt=False
    )
    writer = engine_at(tmp_path / "a", tokenizer, model, disk=False, redis_url=redis_server.url)
    writer.generate(PROMPT, max_new_tokens=2)
    client = redis.Redis.from_url(redis_server.url)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used // 2))
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        client.set("probe", b"x")

    reader = engine_at(tmp_path / "b", tokenizer, model, disk=False, redis_url=redis_server.url)
    tier = reader.store.tier("redis")
    reader.generate(OTHER, max_new_tokens=2)  # every write refused
    assert tier.stats.refused > 0 and tier.stats.outages == 0 and tier.available
    g = reader.generate(PROMPT, max_new_tokens=2)
    assert g.stats["reused_tokens"] > 0 and tier.stats.hits >= len(block_keys_of(reader)) - 1
    assert g.token_ids == reference.token_ids
    torch.testing.assert_close(g.first_logits, reference.first_logits, atol=1e-5, rtol=0)
    assert tier.stats.unavailable == 0


def test_values_over_the_cap_are_not_sent(tmp_path, tokenizer, model, redis_server):
    engine = engine_at(
        tmp_path / "c", tokenizer, model, disk=False, redis_url=redis_server.url, redis_max_value_bytes=1000
    )
    g = engine.generate(PROMPT, max_new_tokens=2)
    tier = engine.store.tier("redis")
    assert g.token_ids and tier.stats.oversize >= len(block_keys_of(engine))
    assert tier.stats.writes == 0 and tier.stats.errors == 0
    client = redis.Redis.from_url(redis_server.url)
    assert not any(client.exists(tier.redis_key(k)) for k in block_keys_of(engine))
    assert engine.generate(PROMPT, max_new_tokens=2).stats["reused_tokens"] > 0  # from memory
