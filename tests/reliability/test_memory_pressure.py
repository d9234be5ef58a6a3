"""A tiny memory budget under a long workload keeps every store invariant after every operation.

Injected: (1) a hypothesis state machine drives a store with a memory tier of 2 KiB (entries of
32-768 bytes) over a disk tier — and a memory-only store — with random puts, gets (right and wrong
token ids), pins, unpins, deletes and puts made while entries are pinned; (2) an engine with a
memory tier of 5 prefix blocks and no disk serves 16 requests over 8 prompts that share prefixes;
(3) while a prefix plan's blocks are pinned, the store is flooded with new entries.

Must happen: after every operation ``MemoryTier.check_invariants()`` holds (byte count = sum of
entries, budget kept unless pinned entries alone exceed it, pins only on resident entries, every
entry under its own key); pin counts equal the model's; pinned entries are never evicted; the
memory index holds only live (not deleted) entries, each identical to what was put; every get is a
miss or exactly the entry put under that key; with a disk tier, every entry whose put returned
True is readable until deleted. Every generation equals the cache-less run.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import semkv.store.tiers as tiers_module
from semkv.store import DiskTier, KVStore, MemoryTier
from semkv.store.keys import EntryKind
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import FP, engine_at, same_kv, small_entry

BUDGET = 2048
RUNS = {"examples": 0, "steps": 0}
tokens_st = st.lists(st.integers(0, 5), min_size=1, max_size=24)


class StoreMachine(RuleBasedStateMachine):
    with_disk = True
    root = None

    def __init__(self) -> None:
        super().__init__()
        RUNS["examples"] += 1
        tiers = [MemoryTier(BUDGET)]
        if self.with_disk:
            import shutil
            import tempfile

            folder = tempfile.mkdtemp(dir=self.root)
            tiers.append(DiskTier(folder))
            self._cleanup = lambda: shutil.rmtree(folder, ignore_errors=True)
        else:
            self._cleanup = lambda: None
        self.store = KVStore(tiers, FP)
        self.memory = self.store.memory
        self.written: dict[str, object] = {}
        self.pins: Counter[str] = Counter()

    def teardown(self) -> None:
        self._cleanup()

    def step(self) -> None:
        RUNS["steps"] += 1

    @rule(tokens=tokens_st)
    def put(self, tokens):
        self.step()
        e = small_entry(tokens)
        pinned_before = {k for k in self.pins if self.pins[k]}
        stored = self.store.put(e)
        if self.with_disk:
            assert stored
        if stored:
            self.written[e.key] = e
        assert all(k in self.memory for k in pinned_before), "a pinned entry was evicted"

    @rule(tokens=tokens_st, right_tokens=st.booleans())
    def get(self, tokens, right_tokens):
        self.step()
        e = small_entry(tokens)
        query = tokens if right_tokens else tokens + [9]
        got = self.store.get(e.key, query, EntryKind.CHUNK)
        if got is not None:
            assert right_tokens and same_kv(got, e), "wrong KV served"
        if right_tokens and self.with_disk and e.key in self.written:
            assert got is not None, "an entry reported written was lost"

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def pin(self, data):
        self.step()
        key = data.draw(st.sampled_from(sorted(self.written)))
        if self.memory.pin(key):
            self.pins[key] += 1
        else:
            assert key not in self.memory

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        self.step()
        key = data.draw(st.sampled_from(sorted(k for k, c in self.pins.items() if c)))
        self.memory.unpin(key)
        self.pins[key] -= 1

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def delete(self, data):
        self.step()
        key = data.draw(st.sampled_from(sorted(self.written)))
        if self.pins[key]:
            with pytest.raises(ValueError, match="cannot delete pinned entry"):
                self.store.delete(key)
            return
        self.store.delete(key)
        del self.written[key]
        assert self.store.get(key) is None

    @rule(tokens=st.lists(tokens_st, min_size=1, max_size=6))
    def put_while_pinned(self, tokens):
        """A request holding its blocks pinned while other entries arrive."""
        self.step()
        resident = [k for k in self.written if k in self.memory][:3]
        with self.store.pinned(resident):
            for t in tokens:
                e = small_entry(t)
                if self.store.put(e):
                    self.written[e.key] = e
                assert all(k in self.memory for k in resident), "a pinned entry was evicted"

    @invariant()
    def store_invariants(self):
        self.memory.check_invariants()
        assert {k: c for k, c in self.pins.items() if c} == {
            k: self.memory.pin_count(k) for k in self.memory.keys() if self.memory.pin_count(k)
        }
        assert all(k in self.memory for k, c in self.pins.items() if c)
        for key in self.memory.keys():  # the index points only at live entries, each exact
            assert key in self.written and same_kv(self.memory.peek(key), self.written[key])
        assert self.memory.nbytes() <= BUDGET or all(self.memory.pin_count(k) for k in self.memory.keys())
        if self.with_disk:
            assert set(self.store.tiers[1].keys()) == set(self.written)


class MemoryOnlyMachine(StoreMachine):
    with_disk = False


@pytest.fixture
def fast_fsync(monkeypatch):
    """fsync is about power loss, not logic: skip it so thousands of steps run in seconds."""
    monkeypatch.setattr(tiers_module.os, "fsync", lambda fd: None)


@pytest.mark.parametrize(
    ("machine", "examples", "steps"),
    [(StoreMachine, 50, 30), (MemoryOnlyMachine, 60, 40)],
    ids=["memory+disk", "memory-only"],
)
def test_store_invariants_under_random_operations(machine, examples, steps, tmp_path, fast_fsync):
    before = dict(RUNS)
    machine.root = str(tmp_path)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    runs, ops = RUNS["examples"] - before["examples"], RUNS["steps"] - before["steps"]
    print(f"\n[memory-pressure] {machine.__name__}: {runs} runs, {ops} operations, invariants held")
    assert runs >= examples


PROMPTS = [
    "Report: the harvest was early this year.",
    "Report: the harvest was late this year.",
    "Report: the harvest was early this year, and the rain came in May.",
    "Summary of the meeting about the new bridge and its costs.",
    "Summary of the meeting about the old bridge.",
    "A poem about the sea at night.",
    "A poem about the sea at dawn, with gulls.",
    "Report: the harvest was early.",
]


def test_long_workload_with_a_five_block_budget(tmp_path, tokenizer):
    model = tiny_hf_model("llama", len(tokenizer))
    ref_engine = engine_at(tmp_path / "ref", tokenizer, model, disk=False)
    refs = {
        p: ref_engine.generate(p, max_new_tokens=1, reuse="none", store_prompt=False, use_chat_template=False)
        for p in PROMPTS
    }
    block_bytes = 2 * 2 * 4 * 16 * 4 * 2  # layers * kv heads * tokens * head dim * fp32 * (k, v)
    engine = engine_at(tmp_path / "home", tokenizer, model, disk=False, memory_bytes=5 * block_bytes)
    memory = engine.store.memory
    reused = 0
    for p in PROMPTS * 2:
        g = engine.generate(p, max_new_tokens=1, use_chat_template=False)  # a few blocks per prompt
        assert g.token_ids == refs[p].token_ids
        torch.testing.assert_close(g.first_logits, refs[p].first_logits, atol=1e-5, rtol=0)
        memory.check_invariants()
        assert memory.nbytes() <= 5 * block_bytes and not any(memory.pin_count(k) for k in memory.keys())
        reused += g.stats["reused_tokens"]
    assert memory.stats.evictions > 0 and reused > 0  # both pressure and reuse happened


def test_pinned_blocks_survive_a_flood_during_prefill(tmp_path, tokenizer, monkeypatch):
    engine = engine_at(tmp_path / "home", tokenizer, disk=False, memory_bytes=40 * 2048)
    prompt = PROMPTS[0]
    first = engine.generate(prompt, max_new_tokens=1)
    engine.drop_page_pool()  # the hit must come from the store's memory tier, under pressure
    memory = engine.store.memory
    real_load = engine.runtime.load_pieces  # where the store's blocks enter the cache
    seen = {}

    def load_pieces_after_flood(cache, pieces, positions, token_ids):
        pinned = [key for key in memory.keys() if memory.pin_count(key)]
        for i in range(200):  # far more than the budget holds
            engine.store.put(small_entry([i, *range(30)], fp=engine.fingerprint))
        memory.check_invariants()
        seen["pinned"] = pinned
        seen["resident"] = all(key in memory for key in pinned)
        return real_load(cache, pieces, positions, token_ids)

    monkeypatch.setattr(engine.runtime, "load_pieces", load_pieces_after_flood)
    g = engine.generate(prompt, max_new_tokens=1)
    assert g.stats["reused_tokens"] > 0 and seen["pinned"] and seen["resident"]
    assert memory.stats.evictions > 0
    assert g.token_ids == first.token_ids
    torch.testing.assert_close(g.first_logits, first.first_logits, atol=1e-5, rtol=0)
    assert not any(memory.pin_count(k) for k in memory.keys())
