"""Redis down, killed, restarted, paused or damaged: each request is bounded, correct, and reuse resumes.

Injected (a real ``redis-server`` on a free loopback port; engines with memory + Redis tiers and no
disk, so Redis is the only shared tier): (1) Redis not running when the engine starts, started
later; (2) Redis killed after it holds a prompt's blocks, then restarted empty; (3) Redis paused
with SIGSTOP (it accepts connections and never answers) while a fresh engine needs its blocks, then
resumed with SIGCONT; (4) every stored Redis value damaged (flipped byte, truncated, swapped with
another key's value). Time in Redis is measured per call by wrapping the tier's guarded call; the
circuit breaker's clock is advanced by hand, so recovery needs no sleeping.

Must happen: the engine starts and every request completes with output identical to a cache-less
run; no Redis call takes longer than its timeout (plus slack) and a request spends at most two
timeouts in Redis; outages are counted and logged as a warning; once Redis answers again, writes
land in it and a fresh engine reuses them; after SIGCONT, replies that arrive late are never taken
for another key's value (every entry read has the key asked for); damaged values are counted
misses and deleted.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import redis
import torch

from tests.conftest import RedisServer, tiny_hf_model
from tests.reliability.reliability_helpers import block_keys_of, engine_at

TIMEOUT_S = 0.2
SLACK_S = 0.6  # scheduling noise on a loaded 2-core machine
PROMPTS = [
    "Redis fault one: the engine must answer correctly.",
    "Redis fault two: a second prompt, written after recovery.",
    "Redis fault three: yet another prompt for a fresh engine.",
]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_hf_model("llama", len(tokenizer))


@pytest.fixture(scope="module")
def refs(model, tokenizer, tmp_path_factory):
    engine = engine_at(tmp_path_factory.mktemp("ref"), tokenizer, model, disk=False)
    return {p: engine.generate(p, max_new_tokens=2, reuse="none", store_prompt=False) for p in PROMPTS}


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 60.0) -> None:
        self.now += seconds


def redis_engine(tmp_path, tokenizer, model, url, clock):
    """An engine with memory + Redis tiers; every Redis call timed; the breaker on a manual clock."""
    engine = engine_at(tmp_path, tokenizer, model, disk=False, redis_url=url, redis_timeout_s=TIMEOUT_S)
    tier = engine.store.tier("redis")
    tier.breaker.clock = clock
    tier.call_times = []
    real_call = tier.call

    def timed_call(fn, default, key=None):
        start = time.perf_counter()
        try:
            return real_call(fn, default, key)
        finally:
            tier.call_times.append(time.perf_counter() - start)

    tier.call = timed_call
    return engine, tier


def serve(engine, tier, prompt, refs):
    """Generate; check output equals the cache-less run and Redis time stayed bounded."""
    tier.call_times.clear()
    g = engine.generate(prompt, max_new_tokens=2)
    assert g.token_ids == refs[prompt].token_ids
    torch.testing.assert_close(g.first_logits, refs[prompt].first_logits, atol=1e-5, rtol=0)
    slow = [t for t in tier.call_times if t > TIMEOUT_S / 2]
    assert max(tier.call_times, default=0.0) < TIMEOUT_S + SLACK_S, tier.call_times
    assert len(slow) <= 2, f"{len(slow)} slow Redis calls in one request: {slow}"
    return g


def test_redis_not_running_at_start(tmp_path, tokenizer, model, refs, caplog):
    server = RedisServer(tmp_path)  # a free port, nothing listening yet
    clock = Clock()
    try:
        with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
            engine, tier = redis_engine(tmp_path / "a", tokenizer, model, server.url, clock)
            g = serve(engine, tier, PROMPTS[0], refs)
            assert g.stats["reused_tokens"] == 0
            serve(engine, tier, PROMPTS[1], refs)
        assert not tier.available and tier.stats.outages == 1 and tier.stats.writes == 0
        assert any("unavailable" in r.message for r in caplog.records)

        server.start()
        clock.advance()
        serve(engine, tier, PROMPTS[2], refs)  # the trial call succeeds: writes land in Redis
        assert tier.available and tier.stats.writes > 0
        fresh, fresh_tier = redis_engine(tmp_path / "b", tokenizer, model, server.url, Clock())
        g = serve(fresh, fresh_tier, PROMPTS[2], refs)
        assert g.stats["reused_tokens"] > 0 and fresh_tier.stats.hits > 0
    finally:
        server.stop()


def test_redis_killed_mid_run_then_restarted(tmp_path, tokenizer, model, refs, redis_server, caplog):
    clock = Clock()
    writer, writer_tier = redis_engine(tmp_path / "w", tokenizer, model, redis_server.url, clock)
    serve(writer, writer_tier, PROMPTS[0], refs)
    assert writer_tier.stats.writes > 0
    redis_server.stop()

    reader, tier = redis_engine(tmp_path / "r", tokenizer, model, redis_server.url, clock)
    with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
        g = serve(reader, tier, PROMPTS[0], refs)
        assert g.stats["reused_tokens"] == 0 and tier.stats.errors >= 1
        serve(writer, writer_tier, PROMPTS[1], refs)  # the writer's next request: also bounded, correct
    assert any("unavailable" in r.message for r in caplog.records)

    redis_server.start()  # back, empty (no persistence)
    clock.advance()
    serve(writer, writer_tier, PROMPTS[2], refs)
    assert writer_tier.available
    fresh, fresh_tier = redis_engine(tmp_path / "f", tokenizer, model, redis_server.url, Clock())
    g = serve(fresh, fresh_tier, PROMPTS[2], refs)
    assert g.stats["reused_tokens"] > 0 and fresh_tier.stats.hits > 0


def test_redis_paused_with_sigstop(tmp_path, tokenizer, model, refs, redis_server, caplog):
    clock = Clock()
    writer, writer_tier = redis_engine(tmp_path / "w", tokenizer, model, redis_server.url, clock)
    serve(writer, writer_tier, PROMPTS[0], refs)
    keys = block_keys_of(writer, PROMPTS[0])
    reader, tier = redis_engine(tmp_path / "r", tokenizer, model, redis_server.url, clock)
    assert tier.ping()  # its connection is open before the pause

    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="semkv.store.redis_tier"):
            start = time.perf_counter()
            g = serve(reader, tier, PROMPTS[0], refs)
            first = time.perf_counter() - start
            assert g.stats["reused_tokens"] == 0 and tier.stats.errors >= 1
            g = serve(reader, tier, PROMPTS[1], refs)  # circuit open: no Redis wait at all
            assert all(t < TIMEOUT_S / 2 for t in tier.call_times) and tier.stats.unavailable > 0
        assert any("unavailable" in r.message for r in caplog.records)
        print(f"\n[redis-paused] first request {first:.2f} s, Redis calls bounded by {TIMEOUT_S} s")
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)

    clock.advance()
    assert tier.ping() and tier.available
    for key in keys:  # late replies to the timed-out calls are never read as another key's value
        entry = tier.get(key)
        assert entry is not None and entry.key == key
    assert tier.stats.corrupt == 0
    fresh, fresh_tier = redis_engine(tmp_path / "f", tokenizer, model, redis_server.url, Clock())
    g = serve(fresh, fresh_tier, PROMPTS[0], refs)
    assert g.stats["reused_tokens"] > 0


def test_damaged_redis_values(tmp_path, tokenizer, model, refs, redis_server):
    clock = Clock()
    writer, writer_tier = redis_engine(tmp_path / "w", tokenizer, model, redis_server.url, clock)
    serve(writer, writer_tier, PROMPTS[0], refs)
    keys = block_keys_of(writer, PROMPTS[0])
    client = redis.Redis.from_url(redis_server.url)
    names = [writer_tier.redis_key(k) for k in keys]
    values = [client.get(n) for n in names]
    for i, (name, value) in enumerate(zip(names, values, strict=True)):
        if i % 3 == 0:
            damaged = bytearray(value)
            damaged[len(damaged) // 2] ^= 0x08
            client.set(name, bytes(damaged))
        elif i % 3 == 1:
            client.set(name, value[: len(value) // 3])
        else:
            client.set(name, values[(i + 1) % len(values)])  # another key's (valid) entry
    reader, tier = redis_engine(tmp_path / "r", tokenizer, model, redis_server.url, clock)
    g = serve(reader, tier, PROMPTS[0], refs)
    assert g.stats["reused_tokens"] == 0 and tier.stats.corrupt == 1  # block 0 damaged: the chain stops
    rewritten = tier.get(keys[0])  # deleted, then written again whole by the reader's full prefill
    assert rewritten is not None and rewritten.key == keys[0]
    for key in keys[1:]:
        assert tier.get(key) is None  # every damaged value: a miss ...
    assert tier.stats.corrupt == len(keys)  # ... counted ...
    assert not any(client.exists(n) for n in names[1:])  # ... and deleted
    client.close()
