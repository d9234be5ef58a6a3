"""The router's choice of backend, without processes: the hash ring, the affinity key of every route,
the bounded-load spill-over, dead backends last, and the router's config checks."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from semkv.route import BackendPool, HashRing, RouterConfig, affinity_key
from semkv.route.ring import document_id
from semkv.server.documents import document_id as server_document_id

URLS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_ring_is_stable_balanced_and_moves_little():
    keys = [f"text:prompt number {i}" for i in range(3000)]
    ring = HashRing(URLS)
    owners = [ring.order(k)[0] for k in keys]
    assert owners == [
        HashRing(list(reversed(URLS))).order(k)[0] for k in keys
    ]  # order of the list is irrelevant
    counts = Counter(owners)
    assert all(700 <= counts[u] <= 1300 for u in URLS), counts
    assert all(sorted(ring.order(k)) == sorted(URLS) for k in keys[:50])  # every node, owner first
    grown = HashRing(URLS + ["http://127.0.0.1:8004"])
    moved = sum(a != grown.order(k)[0] for a, k in zip(owners, keys, strict=True))
    assert moved == sum(grown.order(k)[0] == "http://127.0.0.1:8004" for k in keys)  # only to the new node
    assert 450 <= moved <= 1050, moved  # about a quarter
    with pytest.raises(ValueError):
        HashRing([])
    with pytest.raises(ValueError):
        HashRing(URLS + URLS[:1])


def test_affinity_key_of_every_route():
    long = "System rules. " * 40
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": long}, {"role": "user", "content": "Q1"}],
    }
    chat2 = {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "another question"}]}
    assert affinity_key("POST", "/v1/chat/completions", body(**chat)) == affinity_key(
        "POST", "/v1/chat/completions", body(**chat2)
    )  # same first blocks, same key
    parts = {**chat, "messages": [{"role": "system", "content": [{"type": "text", "text": long}]}]}
    assert affinity_key("POST", "/v1/chat/completions", body(**parts)) == affinity_key(
        "POST", "/v1/chat/completions", body(**chat)
    )
    assert (
        affinity_key("POST", "/v1/completions", body(prompt="abc" * 200), prefix_chars=10)
        == "text:" + "abc" * 3 + "a"
    )
    assert affinity_key("POST", "/v1/completions", body(prompt=["first", "second"])) == "text:first"
    docs = {"model": "m", "prompt": "q", "semkv": {"documents": ["doc-" + "1" * 32, "doc-" + "2" * 32]}}
    assert affinity_key("POST", "/v1/completions", body(**docs)) == "doc:doc-" + "1" * 32
    inline = {"model": "m", "prompt": "q", "semkv": {"chunks": ["ctx " * 100]}}
    assert affinity_key("POST", "/v1/completions", body(**inline), prefix_chars=8) == "text:ctx ctx "
    upload = affinity_key("POST", "/v1/documents", body(input=["Doc one.", "Doc two."]))
    assert upload == "doc:" + server_document_id("Doc one.") == "doc:" + document_id("Doc one.")
    assert affinity_key("GET", "/v1/documents/doc-" + "3" * 32, b"") == "doc:doc-" + "3" * 32
    for method, path, raw in [
        ("GET", "/v1/models", b""),
        ("GET", "/v1/documents", b""),
        ("POST", "/v1/completions", b"not json"),
        ("POST", "/v1/completions", b"[1, 2]"),
        ("POST", "/v1/completions", body(prompt=7)),
        ("POST", "/v1/chat/completions", body(messages="x")),
    ]:
        assert affinity_key(method, path, raw) is None, (method, path, raw)


def test_pool_prefers_the_owner_until_it_is_too_loaded():
    pool = BackendPool(URLS, max_imbalance=2)
    key = "doc:doc-" + "a" * 32
    order = [pool.by_url[u] for u in pool.ring.order(key)]
    assert pool.candidates(key) == (order, "affinity")
    order[0].in_flight = 1  # one more than the others: after this request two more, within the bound
    assert pool.candidates(key) == (order, "affinity")
    order[0].in_flight = 2  # it would be three above: spills to the next on the ring
    chosen, reason = pool.candidates(key)
    assert reason == "balanced" and chosen[0] is order[1] and sorted(b.url for b in chosen) == sorted(URLS)
    order[1].in_flight = 2
    assert pool.candidates(key)[0][0] is order[2]
    pool.mark(order[2], False, "refused")
    chosen, reason = pool.candidates(key)
    assert chosen[-1] is order[2] and chosen[0] is order[0] and reason == "affinity"  # down: last
    assert order[2].failures == 1 and order[2].last_error == "refused"
    for b in pool.backends:
        b.in_flight = 0
    order[0].in_flight, order[0].routed = 0, 5
    order[1].routed = 2
    assert pool.candidates(None) == ([order[1], order[0], order[2]], "least_loaded")


@pytest.mark.parametrize("max_imbalance", [0, 1])
def test_small_imbalance_is_least_loaded_with_the_owner_first(max_imbalance):
    pool = BackendPool(URLS, max_imbalance=max_imbalance)
    key = "text:a prompt"
    order = [pool.by_url[u] for u in pool.ring.order(key)]
    assert pool.candidates(key) == (order, "affinity")  # all idle: the owner (first among the least)
    order[0].in_flight = 1
    assert pool.candidates(key) == ([order[1], order[0], order[2]], "balanced")
    order[1].in_flight = 1
    assert pool.candidates(key)[0][0] is order[2]
    order[2].in_flight = 1  # all equal again: the owner
    assert pool.candidates(key)[0][0] is order[0]


def test_requests_arriving_together_are_spread():
    """Four requests for one key, none finished: with the default bound they end up two and two."""
    pool = BackendPool(URLS[:2])
    for _ in range(4):
        pool.candidates("doc:doc-" + "b" * 32)[0][0].in_flight += 1
    assert sorted(b.in_flight for b in pool.backends) == [2, 2]


def test_router_config_checks():
    with pytest.raises(ValueError, match="backends"):
        RouterConfig(backends=[])
    with pytest.raises(ValueError, match="base URL"):
        RouterConfig(backends=["127.0.0.1:8000"])
    with pytest.raises(ValueError, match="duplicate"):
        RouterConfig(backends=["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="max_imbalance"):
        RouterConfig(backends=["http://a:1"], max_imbalance=-1)
    assert RouterConfig(backends=["http://a:1/"]).backends == ["http://a:1"]
