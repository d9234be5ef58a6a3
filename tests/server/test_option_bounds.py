"""Every engine option a client can send is bounded, typed, and refused with a 400 that names it.

Injected (one in-process app for the module): the memory bomb found on the old server
(``"share": {"simhash": {"tables": 10000000}}``, a 500 after trying to allocate terabytes), a table of
out-of-range, mistyped and server-only values for every option; 300 hypothesis-generated ``semkv``
objects mixing valid values with huge numbers, floats for ints, strings, nulls and nested junk; and
64 requests each asking for the largest allowed token hasher with a new seed (the old server kept one
hasher per distinct setting forever).

Must hold: each table entry is a 400 whose ``param`` is the option's path (``semkv.share.simhash.
tables``); no fuzzed request is a 5xx; after a warm-up the process's memory grows less than 60 MB
over 48 more hasher seeds (at most ``MAX_HASHERS`` hashers of ~17 MB are kept); the server still answers.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from semkv.reuse.lsh import SimHashConfig
from semkv.reuse.options import BlendConfig, ShareConfig
from semkv.reuse.share import MAX_HASHERS
from semkv.server import ServerConfig
from tests.server.memory import rss_mb

TINY = "tiny"
LONG = "The tide tables for the northern harbour are printed every spring by the port office. " * 5

BAD = [
    ({"share": {"simhash": {"tables": 10_000_000}}}, "semkv.share.simhash.tables"),
    ({"share": {"simhash": {"tables": 2.5}}}, "semkv.share.simhash.tables"),
    ({"share": {"simhash": {"bits": 63}}}, "semkv.share.simhash.bits"),
    ({"share": {"simhash": {"position_features": 10**6}}}, "semkv.share.simhash.position_features"),
    ({"share": {"simhash": {"position_features": 7}}}, "semkv.share.simhash.position_features"),
    ({"share": {"simhash": {"position_weight": 1e308}}}, "semkv.share.simhash.position_weight"),
    ({"share": {"simhash": {"min_wavelength": 0}}}, "semkv.share.simhash.min_wavelength"),
    ({"share": {"simhash": {"min_wavelength": 100.0, "max_wavelength": 90.0}}}, "semkv.share.simhash"),
    ({"share": {"simhash": {"seed": -1}}}, "semkv.share.simhash.seed"),
    ({"share": {"simhash": {"seed": 2**70}}}, "semkv.share.simhash.seed"),
    ({"share": {"simhash": {"tables": True}}}, "semkv.share.simhash.tables"),
    ({"share": {"simhash": {"nope": 1}}}, "semkv.share.simhash.nope"),
    ({"share": {"simhash": [1, 2]}}, "semkv.share.simhash"),
    ({"share": {"anchor": 10**9}}, "semkv.share.anchor"),
    ({"share": {"candidates": 10**6}}, "semkv.share.candidates"),
    ({"share": {"min_tokens": 1.5}}, "semkv.share.min_tokens"),
    ({"share": {"min_tokens": 10**12}}, "semkv.share.min_tokens"),
    ({"share": {"recompute_last": 0}}, "semkv.share.recompute_last"),
    ({"share": {"decay": 0}}, "semkv.share.decay"),
    ({"share": {"min_similarity": "high"}}, "semkv.share.min_similarity"),
    ({"share": {"schedule": "linear"}}, "semkv.share.schedule"),
    ({"share": {"unknown": 1}}, "semkv.share.unknown"),
    ({"share": "x"}, "semkv.share"),
    ({"blend": {"sink": "none"}}, "semkv.blend.sink"),
    ({"blend": {"separator_in_chunk": False}}, "semkv.blend.separator_in_chunk"),
    ({"blend": {"check_layer": 10**9}}, "semkv.blend.check_layer"),
    ({"blend": {"gradual": "yes"}}, "semkv.blend.gradual"),
    ({"blend": {"recompute_ratio": 2}}, "semkv.blend.recompute_ratio"),
    ({"blend": {"deviation_on": "q"}}, "semkv.blend.deviation_on"),
    ({"blend": 5}, "semkv.blend"),
    ({"recompute_ratio": -1}, "semkv.recompute_ratio"),
    ({"kv_budget": 0}, "semkv.kv_budget"),
    ({"kv_budget": 1.5}, "semkv.kv_budget"),
    ({"sparse_reselect_every": 0}, "semkv.sparse_reselect_every"),
    ({"sparse_reselect_every": 2.0}, "semkv.sparse_reselect_every"),
    ({"sparse_reselect_every": True}, "semkv.sparse_reselect_every"),
    ({"sparse_reselect_every": 10**6}, "semkv.sparse_reselect_every"),
    ({"sparse": "bogus"}, "semkv.sparse"),
    ({"sparse": {}}, "semkv.sparse"),
    ({"store_prompt": "no"}, "semkv.store_prompt"),
    ({"stop_at_eos": 1}, "semkv.stop_at_eos"),
    ({"use_chat_template": 3}, "semkv.use_chat_template"),
    ({"reuse": 7}, "semkv.reuse"),
    ({"tenant": "alice"}, "semkv.tenant"),
    ({"cache_salt": "x"}, "semkv.cache_salt"),
    ({"max_new_tokens": 3}, "semkv.max_new_tokens"),
    ({"nonsense": 1}, "semkv.nonsense"),
]


@pytest.fixture(scope="module")
def client(module_client_factory):
    return module_client_factory(ServerConfig(completion_max_tokens=1, chat_max_tokens=1))


@pytest.mark.parametrize("options,param", BAD, ids=[p for _, p in BAD])
def test_bad_option_is_a_400_naming_it(client, options, param):
    r = client.post(
        "/v1/completions", json={"model": TINY, "prompt": "Hi", "max_tokens": 1, "semkv": options}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()["error"]


def test_salt_is_bounded(client):
    r = client.post("/v1/completions", json={"model": TINY, "prompt": "Hi", "cache_salt": "s" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = client.get("/v1/documents", params={"cache_salt": "s" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 3, 62, 63, 64, 65, 1024, 10**6, 10**9, -1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 0.5, 1.0, 1e308, -1e-9, 2.5]),
    st.text(max_size=8),
    st.sampled_from(["k", "v", "kv", "bos", "none", "template", "constant", "drop", "reuse"]),
    st.lists(st.integers(0, 3), max_size=2),
)
simhash = st.fixed_dictionaries({}, optional={name: junk for name in field_names(SimHashConfig)})
share = st.fixed_dictionaries(
    {}, optional={**{n: junk for n in field_names(ShareConfig) if n != "simhash"}, "simhash": simhash | junk}
)
server_only = ("sink", "separator_in_chunk")
blend = st.fixed_dictionaries(
    {}, optional={n: junk for n in field_names(BlendConfig) if n not in server_only}
)
options = st.fixed_dictionaries(
    {},
    optional={
        "share": share | junk,
        "blend": blend | junk,
        "reuse": st.sampled_from(["auto", "none", "prefix", "blend", "share"]) | junk,
        "recompute_ratio": junk,
        "kv_budget": junk,
        "sparse_reselect_every": junk,
        "sparse": st.sampled_from(["dense", "keykey", "quest", "bogus"]) | junk,
        "store_prompt": junk,
        "stop_at_eos": junk,
        "use_chat_template": junk,
    },
)
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
STATUSES: dict[int, int] = {}


@FUZZ
@given(options=options, long=st.booleans())
def test_fuzzed_options_never_5xx(client, options, long):
    body = {"model": TINY, "prompt": LONG if long else "Hi", "max_tokens": 1, "semkv": options}
    r = client.post("/v1/completions", json=body)
    event(f"HTTP {r.status_code}")
    STATUSES[r.status_code] = STATUSES.get(r.status_code, 0) + 1
    assert r.status_code in (200, 400), (options, r.status_code, r.text[:300])
    if r.status_code == 400:
        assert r.json()["error"]["param"].startswith("semkv"), r.json()


def test_memory_stays_bounded_over_the_fuzz_and_many_hasher_settings(client):
    """After the fuzz above: 16 warm-up requests, then 48 more, each a new seed of the largest token
    hasher (~17 MB each: an unbounded cache would grow ~800 MB over the 48)."""

    def ask(seed: int) -> None:
        simhash_options = {"bits": 62, "tables": 64, "position_features": 1024, "seed": seed}
        body = {
            "model": TINY,
            "prompt": f"{LONG} Edition {seed}.",  # a new prompt: remembered, so hashed with these settings
            "max_tokens": 1,
            "semkv": {"reuse": "none", "share": {"min_tokens": 2, "simhash": simhash_options}},
        }
        assert client.post("/v1/completions", json=body).status_code == 200

    for seed in range(16):  # fills the hasher cache and the allocator's arenas
        ask(seed)
    before = rss_mb()
    for seed in range(16, 64):
        ask(seed)
    growth = rss_mb() - before
    print(
        f"\n[option fuzz] statuses {dict(sorted(STATUSES.items()))}; 48 more hasher seeds: RSS +{growth:.1f} MB "
        f"(at most {MAX_HASHERS} hashers kept)"
    )
    assert growth < 60, f"RSS grew {growth:.1f} MB over 48 hasher settings"
    ok = client.post("/v1/completions", json={"model": TINY, "prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200


def test_requests_cannot_change_the_chunk_sink(tiny_app):
    """Injected: a server whose chunks are made with ``sink="none"``; requests that set blend options
    (the old server let a request's blend dict bring the default sink, missing every stored chunk and
    replacing it for everyone) and one that names another sink. Must hold: the document's chunk is hit
    whatever blend options a request sets; naming a sink is a 400; the stored chunk is never replaced."""
    from fastapi.testclient import TestClient

    config = ServerConfig(defaults={"blend": {"sink": "none"}}, debug_stats=True)
    with TestClient(tiny_app(config), raise_server_exceptions=False) as c:
        doc = c.post("/v1/documents", json={"input": "The ferry leaves at noon from pier four."}).json()[
            "data"
        ][0]
        body = {"model": TINY, "prompt": "When does it leave?", "max_tokens": 1}
        for blend in ({"recompute_ratio": 0.3}, {"check_layer": 1, "gradual": True}, {}):
            semkv = {"documents": [doc["id"]], "reuse": "blend", "blend": blend}
            stats = c.post("/v1/completions", json={**body, "semkv": semkv}).json()["semkv"]
            assert stats["path"] == "blend" and stats["chunk_hits"] == 1, (blend, stats)
        semkv = {"documents": [doc["id"]], "reuse": "blend", "blend": {"sink": "bos"}}
        r = c.post("/v1/completions", json={**body, "semkv": semkv})
        assert r.status_code == 400 and r.json()["error"]["param"] == "semkv.blend.sink"
