"""Two ``semkv serve`` processes sharing a real Redis Cluster (3 masters + 3 replicas), behind ``semkv route``.

The backends keep no KV of their own (memory tier 0, no disk): every reuse is read from the cluster.

Injected: every ``/v1`` route through the router and straight to a backend (streamed and not, errors
too); documents uploaded through the router, then named in requests sent to each backend directly and
through the router; a prompt prefilled by one backend, then sent to the other.

Must hold: the router answers exactly what the backend answers; either backend blends an uploaded
document from the chunk KV in the cluster (the one that did not compute it has Redis hits and wrote no
chunk), with the same greedy answer; requests naming a document go to one backend; a prompt prefilled
on one backend is reused by the other from the cluster.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.route.serving_helpers import TINY, start_routed_pair

DOCS = [
    "The lighthouse keeper on the northern island logs every passing ship in a green ledger. "
    "In the winter of the great storm he recorded forty-one vessels, and all of them reached port safely.",
    "Marmalade was first sold in Dundee by a grocer whose ship had brought a cargo of bitter oranges. "
    "His wife boiled them with sugar, and the jars sold out in a single afternoon at the harbour market.",
]


@pytest.fixture(scope="module")
def pair(redis_cluster, tiny_checkpoint_shared, tmp_path_factory):
    started = start_routed_pair(tiny_checkpoint_shared, redis_cluster.url, tmp_path_factory.mktemp("pair"))
    yield started
    started.stop()


def streamed_text(url: str, body: dict) -> tuple[str, dict]:
    parts, stats = [], {}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                stats = chunk.get("semkv", stats)
    return "".join(parts), stats


def test_every_route_answers_as_the_backend_does(pair):
    router, direct = pair.router.url, pair.backends[0].url
    assert httpx.get(f"{router}/v1/models").json() == httpx.get(f"{direct}/v1/models").json()
    completion = {"model": TINY, "prompt": "Tell me about the sea.", "max_tokens": 4, "temperature": 0}
    routed = httpx.post(f"{router}/v1/completions", json=completion, timeout=60)
    assert routed.status_code == 200
    assert (
        routed.json()["choices"]
        == httpx.post(f"{direct}/v1/completions", json=completion, timeout=60).json()["choices"]
    )
    text, stats = streamed_text(f"{router}/v1/completions", completion)
    assert text == routed.json()["choices"][0]["text"] and stats["path"]
    chat = {"model": TINY, "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 3}
    routed_chat = httpx.post(f"{router}/v1/chat/completions", json=chat, timeout=60)
    assert (
        routed_chat.json()["choices"]
        == httpx.post(f"{direct}/v1/chat/completions", json=chat, timeout=60).json()["choices"]
    )
    assert (
        streamed_text(f"{router}/v1/chat/completions", chat)[0]
        == routed_chat.json()["choices"][0]["message"]["content"]
    )
    for bad in (
        {**completion, "model": "other"},  # 404 model_not_found
        {**completion, "max_tokens": -1},  # 400
        {**completion, "semkv": {"documents": ["doc-" + "0" * 32]}},  # 404 document_not_found
    ):
        r, d = (
            httpx.post(f"{router}/v1/completions", json=bad),
            httpx.post(f"{direct}/v1/completions", json=bad),
        )
        assert (r.status_code, r.json()["error"]["code"]) == (d.status_code, d.json()["error"]["code"])


def test_document_uploaded_through_router_is_served_by_either_backend(pair):
    upload = httpx.post(f"{pair.router.url}/v1/documents", json={"input": DOCS}, timeout=120)
    assert upload.status_code == 200
    uploader = next(i for i, b in enumerate(pair.backends) if b.url == upload.headers["x-semkv-backend"])
    other = 1 - uploader
    docs = upload.json()["data"]
    ids = [d["id"] for d in docs]
    assert all(d["precomputed"] for d in docs)
    got = httpx.get(f"{pair.router.url}/v1/documents/{ids[1]}").json()
    assert got["text"] == DOCS[1]
    other_writes = pair.redis_metric(other, "writes")
    other_hits = pair.redis_metric(other, "hits")
    question = {"model": TINY, "prompt": "Who sold the first marmalade?", "max_tokens": 3, "temperature": 0}
    named = {**question, "semkv": {"documents": ids, "reuse": "blend"}}
    answers = []
    for backend in pair.backends:
        r = httpx.post(f"{backend.url}/v1/completions", json=named, timeout=60)
        assert r.status_code == 200, r.text
        stats = r.json()["semkv"]
        assert stats["path"] == "blend" and stats["reused_tokens"] >= 0.5 * sum(d["tokens"] for d in docs), (
            stats
        )
        answers.append(r.json()["choices"][0]["text"])
    assert answers[0] == answers[1]
    assert pair.redis_metric(other, "hits") >= other_hits + len(DOCS)  # the chunk KV came from the cluster
    assert pair.redis_metric(other, "writes") - other_writes < len(DOCS)  # ... not from its own prefill
    via_router = [httpx.post(f"{pair.router.url}/v1/completions", json=named, timeout=60) for _ in range(3)]
    assert {r.headers["x-semkv-backend"] for r in via_router} == {pair.backends[uploader].url}  # affinity
    assert all(r.json()["choices"][0]["text"] == answers[0] for r in via_router)


def test_prefix_prefilled_on_one_backend_is_reused_by_the_other(pair):
    prompt = {"model": TINY, "prompt": " ".join(DOCS) + " Summarise both passages.", "max_tokens": 2}
    first = httpx.post(f"{pair.backends[0].url}/v1/completions", json=prompt, timeout=60).json()
    second = httpx.post(f"{pair.backends[1].url}/v1/completions", json=prompt, timeout=60).json()
    stats = second["semkv"]
    assert stats["path"] == "prefix" and stats["reused_tokens"] >= 0.8 * stats["prompt_tokens"], stats
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
