"""Document records in Redis are scoped to their namespace, like the local ones.

Injected (a real ``redis-server``; registries without a local folder, so Redis is the only place a
record can come from — two servers sharing one Redis): alice uploads a document on server A; server B
looks it up for alice, for bob, for alice with a cache salt and for the anonymous tenant; alice
deletes it on B. With a store secret, an attacker who can write Redis copies alice's signed record to
bob's Redis key, and writes an unsigned record under bob's key.

Must hold: B finds the document for alice only (bob, a salted alice and the anonymous tenant get
None: they do not even learn it exists); a document published to the shared namespace is found by
everyone through ``resolve``; after alice's delete on B, neither server's Redis has it (A, restarted,
gets None); with the secret, neither the copied nor the unsigned record is ever returned for bob.
"""

from __future__ import annotations

import json

import redis

from semkv.server.documents import DocumentRegistry
from semkv.store.keys import Namespace
from semkv.store.redis_tier import RedisTier

ALICE, BOB = Namespace("alice"), Namespace("bob")
SALTED = Namespace("alice", "salt-1")
SECRET = b"deployment-secret-0123456789"


def registry(url: str, secret: bytes | None = None) -> DocumentRegistry:
    return DocumentRegistry(None, RedisTier(url), secret)


def test_redis_records_are_scoped(redis_server):
    server_a, server_b = registry(redis_server.url), registry(redis_server.url)
    doc = DocumentRegistry.new("Alice's private memo about the merger.", 8, [], owner="alice")
    server_a.put(doc, ALICE)
    assert server_b.get(doc.id, ALICE) == doc
    for other in (BOB, SALTED, Namespace()):
        assert server_b.get(doc.id, other) is None and server_b.resolve(doc.id, other) is None

    shared = DocumentRegistry.new("A handbook every tenant may use.", 7, [], shared=True, owner="ops")
    server_a.put(shared, Namespace.shared())
    for who in (ALICE, BOB, Namespace()):
        assert registry(redis_server.url).resolve(shared.id, who) == (shared, Namespace.shared())

    assert server_b.delete(doc.id, BOB) is None  # bob cannot delete what he cannot see
    assert registry(redis_server.url).get(doc.id, ALICE) == doc
    assert server_b.delete(doc.id, ALICE) == doc
    assert registry(redis_server.url).get(doc.id, ALICE) is None


def test_forged_redis_records_are_ignored_with_the_secret(redis_server):
    server_a = registry(redis_server.url, SECRET)
    doc = DocumentRegistry.new("Alice's signed memo.", 5, [], owner="alice")
    server_a.put(doc, ALICE)
    tier = server_a.redis
    assert tier is not None
    client = redis.Redis.from_url(redis_server.url)
    alice_key = tier.record_key("doc", f"{ALICE.folder_name}.{doc.id}")
    bob_key = tier.record_key("doc", f"{BOB.folder_name}.{doc.id}")
    signed = client.get(alice_key)
    assert signed is not None and registry(redis_server.url, SECRET).get(doc.id, ALICE) == doc

    client.set(bob_key, signed)  # alice's signed record moved to bob's key
    assert registry(redis_server.url, SECRET).get(doc.id, BOB) is None
    unsigned = json.loads(signed)
    unsigned.pop("hmac")
    client.set(bob_key, json.dumps(unsigned))
    assert registry(redis_server.url, SECRET).get(doc.id, BOB) is None
    assert registry(redis_server.url).get(doc.id, BOB) == doc  # the control: without the secret it is read
