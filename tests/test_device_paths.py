"""The paths the family matrix does not cover, on every available device (cpu; cuda where there is one):
a prefix hit from the disk tier (memory tier and page pool emptied; entries come back from disk on the host and cross to the device),
seeded sampling, and continuous batching through ``add_request`` / ``step``.

Injected: a tiny random-weight llama on the ``device`` fixture's device. Must happen: the disk-tier hit is
a prefix hit with the full prefill's tokens and logits (within :mod:`tests.tolerances`); one seed gives
one sample, on the device; batched requests give the tokens each gives alone.
"""

from __future__ import annotations

from semkv.config import SchedulerConfig
from tests.tolerances import assert_close_across_kernels

PROMPT = (
    "The harbour master counted the boats every morning, wrote their names in a blue book and sent the "
    "list to the village office before noon. Which boats came back?"
)


def test_a_prefix_hit_from_the_disk_tier(device, make_tiny_engine):
    engine = make_tiny_engine("llama", device=device, disk=True)
    options = dict(max_new_tokens=6, stop_at_eos=False, store_prompt=False)
    full = engine.generate(PROMPT, reuse="none", **options)
    engine.generate(PROMPT, max_new_tokens=1)  # stores its blocks in memory and on disk
    memory, disk = engine.store.memory, engine.store.tier("disk")
    for key in list(memory.keys()):
        memory.delete(key)
    engine.drop_page_pool()  # the device-side pool would serve the hit before any store tier
    hits = disk.stats.hits
    again = engine.generate(PROMPT, reuse="prefix", **options)
    assert disk.stats.hits > hits  # read back from disk, not from memory
    assert again.stats["path"] == "prefix" and again.stats["reused_tokens"] > 0
    assert again.token_ids == full.token_ids
    assert_close_across_kernels(again.first_logits, full.first_logits, engine.hf_model.config)


def test_one_seed_gives_one_sample(device, make_tiny_engine):
    engine = make_tiny_engine("llama", device=device)
    options = dict(max_new_tokens=12, stop_at_eos=False, temperature=1.0, top_p=0.9, store_prompt=False)
    a = engine.generate(PROMPT, seed=5, **options)
    b = engine.generate(PROMPT, seed=5, **options)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert all(0 <= t < engine.adapter.vocab_size for t in a.token_ids)


def test_batched_requests_give_their_own_tokens(device, make_tiny_engine):
    engine = make_tiny_engine("llama", device=device)
    prompts = [PROMPT, "Name three colours.", PROMPT.replace("boats", "ships")]
    options = dict(max_new_tokens=6, stop_at_eos=False, reuse="none", store_prompt=False)
    alone = [engine.generate(p, **options).token_ids for p in prompts]
    engine.scheduler.config = SchedulerConfig(max_running=3)
    ids = [engine.add_request(prompt=p, **options) for p in prompts]
    produced: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.request_id] += out.token_ids
    assert [produced[rid] for rid in ids] == alone
