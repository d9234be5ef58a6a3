"""Paged, content-addressed KV store: keys, entries, tiers."""

from semkv.store.entry import CorruptEntry, KVEntry, UnauthenticatedEntry, decode, encode
from semkv.store.keys import (
    FORMAT_VERSION,
    EntryKey,
    EntryKind,
    Namespace,
    block_key,
    chunk_key,
    prefix_block_keys,
    prompt_key,
)
from semkv.store.store import KVStore, StoreStats
from semkv.store.tiers import DiskTier, MemoryTier, Tier, TierStats

__all__ = [
    "FORMAT_VERSION",
    "CorruptEntry",
    "DiskTier",
    "EntryKey",
    "EntryKind",
    "KVEntry",
    "KVStore",
    "MemoryTier",
    "Namespace",
    "StoreStats",
    "Tier",
    "TierStats",
    "UnauthenticatedEntry",
    "block_key",
    "chunk_key",
    "decode",
    "encode",
    "prefix_block_keys",
    "prompt_key",
]
