"""What the engine calls: a decoder per request and the prefill-time query capture."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from semkv.models.cache import KVCache
from semkv.models.runtime import Runtime
from semkv.sparse.base import SparsePolicy
from semkv.sparse.decoder import SparseConfig, SparseDecoder
from semkv.sparse.index import capture_prefill_queries


def decoder_for(
    policy: str | SparsePolicy | None, kv_budget: float | int, block_size: int, **config: Any
) -> SparseDecoder | None:
    """A decoder for a request, or None for dense decoding (``None`` / ``"dense"``)."""
    from semkv.sparse import make_policy  # the registry lives in the package's __init__

    if policy is None or policy == "dense":
        return None
    chosen = make_policy(policy) if isinstance(policy, str) else policy
    return SparseDecoder(chosen, SparseConfig(kv_budget=kv_budget, **config), block_size)


@contextlib.contextmanager
def prefill_capture(decoder: SparseDecoder | None, runtime: Runtime, cache: KVCache) -> Iterator[None]:
    """Capture the prompt's queries during the prefill inside the block if the policy needs them."""
    if decoder is None or not decoder.policy.needs_prefill_queries:
        yield
        return
    with capture_prefill_queries(runtime, cache) as captured:
        yield
    decoder.prefill = captured
