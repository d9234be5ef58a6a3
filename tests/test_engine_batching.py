"""Continuous batching through the engine: ``add_request`` / ``step`` against one request at a time.

Injected: requests of mixed lengths, reuse paths (full, prefix hit, CacheBlend over stored chunks),
sparse policies and sampling settings, some joining while others decode, some leaving early; one
engine serves them batched, a twin engine (same weights, same store history) serves them one at a
time through ``generate``. Must happen (fp32 compute): every request gets the same tokens, the same
path and the same first-token logits; batches really hold several sequences; a stop string ends a
request in both modes with the same text.
"""

from __future__ import annotations

import pytest
import torch

from semkv.config import SchedulerConfig
from semkv.models.cache import ARENA_ROW_ALIGN
from semkv.request import GenerateRequest
from tests.conftest import tiny_hf_model
from tests.tolerances import assert_close_across_kernels

PROMPT = "Tell me about the harbour, the boats and the fishermen who sail at dawn every day of the week."
LONG = " ".join(f"word{i} is number {i * 7 % 13}." for i in range(40))
CHUNKS = [
    "The harbour of Varna holds forty fishing boats; most of them leave before dawn and return at noon.",
    "Mira Olsen repairs nets in the old shed by the pier. She has done so for thirty-one years.",
]

# (request options, step at which it is added): mixed lengths, paths, policies and sampling
REQUESTS = [
    (dict(prompt="Hi there.", max_new_tokens=3, reuse="none"), 0),
    (dict(prompt=PROMPT, max_new_tokens=9), 0),
    (dict(prompt="Which boats leave first?", chunks=CHUNKS, max_new_tokens=6, reuse="blend"), 0),
    (dict(prompt=LONG, max_new_tokens=7, sparse="keykey", kv_budget=0.3, reuse="none"), 1),
    (dict(prompt=PROMPT + " And the nets?", max_new_tokens=5), 2),  # a prefix hit on request 1's blocks
    (dict(prompt="Say something random.", max_new_tokens=8, temperature=0.9, top_p=0.8, seed=7), 2),
    (dict(prompt=LONG, max_new_tokens=4, sparse="quest", kv_budget=0.25, store_prompt=False), 4),
]

SHARED_PATH = {0, 1, 2, 4, 5}  # the requests above that decode over the shared arena


def serve_batched(engine, requests, max_running: int = 8, max_batched_tokens: int = 512, shared=None):
    """Add each request at its step, step until done; returns (outputs per request, batch sizes).
    ``shared``: a dict that gets, per request, whether its cache was ever bound to the runtime's decode
    arena (the shared batched-attention path) while it ran."""
    engine.scheduler.config = SchedulerConfig(max_running=max_running, max_batched_tokens=max_batched_tokens)
    ids: list[str | None] = [None] * len(requests)
    outputs: dict[str, list] = {}
    sizes: list[int] = []
    step = 0
    while step == 0 or engine.has_unfinished() or any(i is None for i in ids):
        for n, (options, at) in enumerate(requests):
            if at == step:
                ids[n] = engine.add_request(stop_at_eos=False, **options)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        sizes.append(engine.scheduler.last_step.batch_size)
        if shared is not None:
            arena = engine.runtime.arena
            bound = {id(arena.bound(s)) for s in range(len(arena.slots))} if arena is not None else set()
            for entry in engine.scheduler.running:
                n = ids.index(entry.request_id)
                shared[n] = shared.get(n, False) or id(entry.seq.cache) in bound
        step += 1
        assert step < 200
    return [outputs[i] for i in ids], sizes


def wide_tiny_engine(make_tiny_engine, tokenizer):
    """A tiny llama with weights drawn 5x wider than the default, so its greedy output depends on the
    prompt (and on every mistake a batched step could make)."""
    return make_tiny_engine("llama", hf_model=tiny_hf_model("llama", len(tokenizer), initializer_range=0.1))


@pytest.mark.parametrize(("max_running", "max_batched_tokens"), [(8, 512), (3, 48)])
def test_batched_equals_one_at_a_time_fp32(make_tiny_engine, tokenizer, max_running, max_batched_tokens):
    """With a budget of 48 tokens a step, the full prefills go in chunks between decode steps."""
    serial_engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    batch_engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    for engine in (serial_engine, batch_engine):
        engine.add_chunks(CHUNKS)
    serial = [serial_engine.generate(stop_at_eos=False, **options) for options, _ in REQUESTS]
    shared: dict[int, bool] = {}
    batched, sizes = serve_batched(batch_engine, REQUESTS, max_running, max_batched_tokens, shared)
    assert max(sizes) == min(max_running, 6)  # several sequences really decode together
    # dense sequences with rows in position order (full, prefix, and this blend: its chunks' rows sit in
    # prompt order) attend together over the decode arena; those with a sparse decoder go per sequence
    # (with 3 running, request 0 finishes beside sparse ones only: it never has a dense partner)
    together = {n for n, bound in shared.items() if bound}
    at_least = SHARED_PATH if max_running >= 6 else SHARED_PATH - {0}
    assert at_least <= together <= SHARED_PATH, shared
    paths, chunks = set(), []
    for n, (want, outs) in enumerate(zip(serial, batched, strict=True)):
        end = outs[-1]
        assert end.finished and [o.finished for o in outs].count(True) == 1
        got = end.generation
        assert [t for o in outs for t in o.token_ids] == got.token_ids == want.token_ids, n
        assert got.stats["path"] == want.stats["path"], n
        # chunks sum in another order than one piece (and a prefix hit reuses a chunked prefill's KV)
        if max_batched_tokens >= 512:  # one piece both ways: the same kernels, the same bits
            torch.testing.assert_close(got.first_logits, want.first_logits, atol=0, rtol=0)
        else:
            assert_close_across_kernels(
                got.first_logits,
                want.first_logits,
                batch_engine.hf_model.config,
                context=got.stats["prompt_tokens"],
            )
        chunks.append(got.stats.get("prefill_chunks", 1))
        assert "".join(o.text for o in outs) == got.text == want.text
        for key in ("blocks_selected_per_step", "bytes_loaded", "sparse_policy"):  # the sparse decoder ran
            assert got.stats.get(key) == want.stats.get(key), (n, key)
        paths.add(got.stats["path"])
    assert {"full", "prefix", "blend"} <= paths
    assert (max(chunks) > 1) == (max_batched_tokens < 100)  # LONG (~300 tokens) went in pieces


def test_runtime_decode_batch_rows_are_independent(make_tiny_engine, tokenizer):
    """decode_batch over 3 caches gives each row the logits of its own one-sequence decode (fp32)."""
    engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    runtime, tok = engine.runtime, engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("Hello.", PROMPT, LONG)]
    singles, batch = [], []
    for ids in prompts:
        one, many = runtime.new_cache(len(ids) + 2), runtime.new_cache(len(ids) + 2)
        runtime.prefill(one, ids)
        runtime.prefill(many, ids)
        singles.append((one, ids[-1]))
        batch.append(many)
    expected = torch.stack([runtime.decode(cache, token) for cache, token in singles])
    got = runtime.decode_batch(batch, [token for _, token in singles])
    assert_close_across_kernels(got, expected, engine.hf_model.config, context=max(c.length for c in batch))
    assert [c.length for c in batch] == [c.length for c, _ in singles]


def test_chunked_prefill_of_a_long_prompt_while_others_decode(make_tiny_engine, tokenizer):
    """A 600-token prompt arrives while two streams decode: with 128 tokens a step it is prefilled in
    chunks, the streams get a token every step meanwhile, and its tokens equal the one-piece prefill's."""
    engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    long_prompt = " ".join(f"line {i}: the tide was {i * 3 % 11} feet." for i in range(60))
    options = dict(max_new_tokens=5, stop_at_eos=False, reuse="none", store_prompt=False)
    alone = engine.generate(long_prompt, **options)
    assert alone.stats["prompt_tokens"] > 500
    engine.scheduler.config = SchedulerConfig(max_running=8, max_batched_tokens=128)
    streams = [
        engine.add_request(prompt=f"Story {i}.", **{**options, "max_new_tokens": 40}) for i in range(2)
    ]
    engine.step()  # both short prompts prefilled
    rid = engine.add_request(prompt=long_prompt, **options)
    per_step: list[set[str]] = []
    outputs = []
    while engine.has_unfinished():
        outs = engine.step()
        per_step.append({o.request_id for o in outs if o.token_ids})
        outputs += [o for o in outs if o.request_id == rid]
        if not outputs:
            assert set(streams) <= per_step[-1]  # running streams are not stalled by the long prefill
    end = outputs[-1]
    assert end.generation.token_ids == alone.token_ids
    assert end.generation.stats["prefill_chunks"] >= 5
    assert_close_across_kernels(
        end.generation.first_logits,
        alone.first_logits,
        engine.hf_model.config,
        context=alone.stats["prompt_tokens"],
    )


def test_a_prefix_hit_prefills_its_tail_in_chunks(make_tiny_engine, tokenizer):
    """A prompt whose first ~300 tokens are stored as prefix blocks and whose new tail is ~300 tokens,
    under 64 tokens a step: it takes the prefix path, loads the stored rows once, prefills only the tail,
    in several chunks, and its tokens and first logits equal the same request prefilled in one piece."""
    engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    head = " ".join(f"line {i}: the tide was {i * 3 % 11} feet." for i in range(30))
    prompt = head + " " + " ".join(f"row {i}: the wind was {i * 5 % 7} knots." for i in range(30))
    engine.generate(head, max_new_tokens=1)  # stores the head's blocks
    options = dict(max_new_tokens=5, stop_at_eos=False, reuse="prefix", store_prompt=False)
    alone = engine.generate(prompt, **options)
    assert alone.stats["path"] == "prefix" and alone.stats["prefill_chunks"] == 1
    engine.scheduler.config = SchedulerConfig(max_running=8, max_batched_tokens=64)
    rid = engine.add_request(prompt=prompt, **options)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    got = outputs[-1].generation
    assert got.stats["path"] == "prefix" and got.stats["reused_tokens"] == alone.stats["reused_tokens"] > 200
    assert got.stats["recomputed_tokens"] == alone.stats["recomputed_tokens"]
    assert got.stats["prefill_chunks"] >= (alone.stats["recomputed_tokens"] + 63) // 64 >= 3
    assert got.token_ids == alone.token_ids
    assert_close_across_kernels(
        got.first_logits, alone.first_logits, engine.hf_model.config, context=alone.stats["prompt_tokens"]
    )


def test_stop_string_in_generate_and_in_the_scheduler(make_tiny_engine):
    engine = make_tiny_engine("llama")
    free = engine.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, store_prompt=False)
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), free.text
    cut = free.text[: free.text.index(stop)]
    stopped = engine.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, store_prompt=False, stop=[stop])
    assert stopped.text == cut and stopped.stats["finish_reason"] == "stop"
    rid = engine.add_request(
        prompt=PROMPT, max_new_tokens=12, stop_at_eos=False, store_prompt=False, stop=stop
    )
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].generation.text == cut
    assert "".join(o.text for o in outputs) == cut


def _held_storage_bytes(engine) -> int:
    """The oracle: bytes of the distinct storages behind the K/V buffers of the scheduler's live caches
    and the runtime's decode arena."""
    scheduler = engine.scheduler
    caches = [e.seq.cache for e in scheduler.running] + [e.job.cache for e in scheduler.prefilling]
    buffers = [buf for cache in caches for buf in (*cache.k_pre, *cache.k_rot, *cache.v)]
    arena = engine.runtime.arena
    if arena is not None:
        buffers += [*arena.k_pre, *arena.k_rot, *arena.v]
    storages = {buf.untyped_storage().data_ptr(): buf.untyped_storage().nbytes() for buf in buffers}
    return sum(storages.values())


def test_a_request_that_would_grow_the_arena_past_the_budget_waits_for_a_free_slot(
    make_tiny_engine, tokenizer
):
    """max_live_kv_bytes fits two sequences' arena (2 slots) and the peak of moving them in, not a third
    sequence's own cache beside it. A and B start; C arrives once they decode in the arena: it waits (no
    crash, the long prefill rule aside), and starts in A's slot the step after A finishes, adding no
    memory. At every step the held bytes the scheduler reports equal the storages really allocated and
    stay within the budget; the tokens equal the requests served one at a time. (With per-request
    reservations C fitted at once, and the arena doubled to 4 slots past the budget.)"""
    serial_engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    options = dict(stop_at_eos=False, reuse="none", store_prompt=False, use_chat_template=False)
    specs = {"a": ("The boats leave at dawn.", 4), "b": ("The nets dry at noon.", 12)}
    specs["c"] = ("The sails fold at dusk.", 12)
    rows = {
        n: engine.admission(GenerateRequest(prompt=p, max_new_tokens=m, **options)).kv_rows
        for n, (p, m) in specs.items()
    }
    assert rows["a"] < rows["b"] == rows["c"], rows
    row, layers = engine.runtime.kv_bytes_per_token(), engine.runtime.num_layers
    slot = -(-rows["b"] // ARENA_ROW_ALIGN) * ARENA_ROW_ALIGN * row
    own_ab = (rows["a"] + rows["b"]) * row
    limit = 2 * slot + own_ab // layers  # moving A and B into a 2-slot arena peaks here
    assert (rows["a"] + rows["b"] + rows["c"]) * row <= limit  # the old per-request reservations fit C
    engine.scheduler.config = SchedulerConfig(max_running=8, max_live_kv_bytes=limit)
    ids = {
        n: engine.add_request(prompt=p, max_new_tokens=m, **options)
        for n, (p, m) in specs.items()
        if n != "c"
    }
    outputs: dict[str, list] = {}
    first, last = {}, {}
    for step in range(30):
        if step == 2:
            ids["c"] = engine.add_request(prompt=specs["c"][0], max_new_tokens=specs["c"][1], **options)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            first.setdefault(out.request_id, step)
            if out.finished:
                last[out.request_id] = step
        held = engine.scheduler.last_step.live_kv_bytes
        assert held == _held_storage_bytes(engine) <= limit, step
        if step in (1, 2, 3):
            assert held == 2 * slot and len(engine.runtime.arena.slots) == 2, step
        if step in (2, 3):
            assert engine.scheduler.num_waiting == 1 and ids["c"] not in first  # C waits for a slot
        if not engine.has_unfinished():
            break
    assert last[ids["a"]] == 3 and first[ids["c"]] == 4  # C starts the step after A finished
    for n, (prompt, max_new) in specs.items():
        want = serial_engine.generate(prompt, max_new_tokens=max_new, **options)
        assert outputs[ids[n]][-1].generation.token_ids == want.token_ids, n
    assert engine.scheduler.last_step.live_kv_bytes == 0 and engine.runtime.arena is None  # all given back


@pytest.mark.real_model
def test_smollm2_batched_greedy_equals_serial(make_smol_engine):
    """The real model, fp32, chat template: four requests decoded together give the serial tokens."""
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis briefly, in two sentences please.",
        "List three prime numbers.",
    ]
    engine = make_smol_engine()
    options = dict(reuse="none", store_prompt=False)
    serial = [engine.generate(p, max_new_tokens=10 - i, **options).token_ids for i, p in enumerate(prompts)]
    ids = [engine.add_request(prompt=p, max_new_tokens=10 - i, **options) for i, p in enumerate(prompts)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.generation.token_ids for o in engine.step() if o.finished})
    assert [done[i] for i in ids] == serial


def test_cached_prompt_tokens_counts_the_stored_prefix_a_request_would_load(make_tiny_engine, tokenizer):
    """Injected: a ~300-token prompt served (its blocks stored), then the admission of the same prompt
    with a question appended, in the same namespace, in another one, and with reuse="none". Must happen:
    the scheduler's cost estimate counts exactly the stored full blocks the prefix path then loads; none
    in another namespace or without prefix reuse; nothing stored yet counts 0."""
    engine = wide_tiny_engine(make_tiny_engine, tokenizer)
    head = " ".join(f"line {i}: the tide was {i * 3 % 11} feet." for i in range(30))
    longer = GenerateRequest(prompt=head + " Which line had the highest tide?", max_new_tokens=2)
    assert engine.cached_prompt_tokens(engine.admission(longer)) == 0
    engine.generate(head, max_new_tokens=1)
    cached = engine.cached_prompt_tokens(engine.admission(longer))
    served = engine.generate(head + " Which line had the highest tide?", max_new_tokens=1, store_prompt=False)
    assert served.stats["path"] == "prefix" and cached == served.stats["reused_tokens"] > 200
    other = GenerateRequest(prompt=longer.prompt, max_new_tokens=2, cache_salt="tenant-b")
    assert engine.cached_prompt_tokens(engine.admission(other)) == 0
    plain = GenerateRequest(prompt=longer.prompt, max_new_tokens=2, reuse="none")
    assert engine.cached_prompt_tokens(engine.admission(plain)) == 0
