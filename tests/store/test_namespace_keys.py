"""Namespaced keys: the default namespace keeps the keys of stores written before namespaces existed;
any other namespace (a tenant, a cache salt) gets keys that share nothing with another's.

Injected: fixed token ids and fingerprints. Must hold: the default namespace's block, chunk and prompt
keys and prefix digests equal digests pinned from the code before namespaces (so existing stores stay
valid); a tenant, a salt, the same text split differently between tenant and salt, and the shared
namespace all give different keys (and differ from the default).
"""

from __future__ import annotations

import pytest

from semkv.store.keys import (
    DEFAULT_NAMESPACE,
    Namespace,
    block_key,
    chunk_key,
    prefix_block_keys,
    prefix_digests,
    prompt_key,
)

FP = "f" * 64

# Computed by the code before namespaces existed (main at 87867ae).
PINNED = {
    "block": "cc4b288295b665efa95df72e12358a9124d22def250ed4dda62e4c383303584b",
    "prefix": [
        "6fa98ae835a2b03c97a7859c61f5aa68428154bf924243d682ef0eb09b744899",
        "30a899254ca4aece11a0a2e1810a717b2ed425902511c1d7a87b202c00e89464",
    ],
    "chunk": "f1157362461f6807557ec4b69a87212c2490720d4ded2b30f8167ae6055fa267",
    "prompt": "49f55d2ab81b0be8260c1657297106243b572a8e8f06b76c1dc444ac442e0e84",
    "digests": [
        "0beeb85c68d15099450d2d50b77ab76dd37609af0860c3a9e9b13efd54626369",
        "7875e1bf52e3d2715db18da12fea9c2025532dd63f82e22431e0917fe5838b8b",
    ],
}


def keys_of(namespace: Namespace | None) -> dict[str, object]:
    return {
        "block": block_key(FP, 4, None, [1, 2, 3, 4], namespace),
        "prefix": prefix_block_keys(FP, 4, list(range(10)), namespace),
        "chunk": chunk_key(FP, [5, 6, 7], namespace),
        "prompt": prompt_key(FP, [5, 6, 7], namespace),
        "digests": prefix_digests(FP, 4, list(range(10)), namespace),
    }


@pytest.mark.parametrize("namespace", [None, DEFAULT_NAMESPACE, Namespace("", "")])
def test_default_namespace_keys_are_unchanged(namespace):
    assert keys_of(namespace) == PINNED


def test_every_other_namespace_has_its_own_keys():
    namespaces = [
        DEFAULT_NAMESPACE,
        Namespace("alice"),
        Namespace("bob"),
        Namespace("", "alice"),  # a salt equal to another's tenant name
        Namespace("alice", "x"),
        Namespace("alicex"),  # tenant + salt concatenated
        Namespace("alic", "ex"),
        Namespace.shared(),
    ]
    seen: dict[str, Namespace] = {}
    for namespace in namespaces:
        for kind, value in keys_of(namespace).items():
            for key in value if isinstance(value, list) else [value]:
                assert key not in seen, (kind, namespace, seen.get(key))
                seen[key] = namespace
    assert len({n.folder_name for n in namespaces}) == len(namespaces)


def test_namespace_fields_are_checked():
    with pytest.raises(ValueError, match="salt"):
        Namespace("a", "x" * 300)
    with pytest.raises(ValueError, match="tenant"):
        Namespace(3, "")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="salt"):
        Namespace("a", "\ud800")
