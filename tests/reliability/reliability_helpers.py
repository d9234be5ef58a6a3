"""Helpers shared by the reliability tests (a plain module: ``conftest`` is the root's name).

Engines here are tiny random-weight models over the SmolLM2 tokenizer, built so that
several engines can share one home folder (one disk store), like several processes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from semkv.config import EngineConfig, StoreConfig
from semkv.engine import Engine
from semkv.request import GenerateRequest
from semkv.store.entry import MAGIC, KVEntry
from semkv.store.keys import EntryKind, chunk_key, prefix_block_keys
from tests.conftest import tiny_hf_model

FP = "f" * 64

# ~60 prompt tokens with the chat template: 15 prefix blocks of 4 tokens.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def engine_at(
    home: Path,
    tokenizer,
    hf_model=None,
    family: str = "llama",
    kv_dtype: str = "float32",
    block_size: int = 4,
    seed: int = 0,
    **store,
) -> Engine:
    """An engine over a tiny model whose disk store lives in ``home`` (shared by every engine given it)."""
    model = hf_model if hf_model is not None else tiny_hf_model(family, len(tokenizer), seed=seed)
    config = EngineConfig(
        model=family,
        home=home,
        kv_dtype=kv_dtype,
        block_size=block_size,
        store=StoreConfig(**store),
        compute_dtype="float32",
    )
    return Engine(config, model, tokenizer, name=f"tiny-{family}")


def prompt_ids(engine: Engine, prompt: str = PROMPT) -> list[int]:
    return engine.layout(GenerateRequest(prompt=prompt)).token_ids


def block_keys_of(engine: Engine, prompt: str = PROMPT) -> list[str]:
    """The chained prefix-block keys of ``prompt`` as laid out by ``engine``."""
    return prefix_block_keys(engine.fingerprint, engine.config.block_size, prompt_ids(engine, prompt))


def small_entry(tokens: list[int], fp: str = FP, seed: int | None = None, layers: int = 2) -> KVEntry:
    """A tiny chunk entry whose KV is a deterministic function of its tokens (so any read can be checked)."""
    n = len(tokens)
    g = torch.Generator().manual_seed(seed if seed is not None else (sum(tokens) * 31 + n))
    k = torch.randn(layers, 1, n, 4, generator=g).half()
    v = torch.randn(layers, 1, n, 4, generator=g).half()
    return KVEntry(chunk_key(fp, tokens), EntryKind.CHUNK, fp, list(tokens), k, v)


HAMMER_ROUNDS = 3  # rounds of the multi-process concurrency tests
HAMMER_ENTRIES = 12  # entries every process writes per round


def hammer_entries(round_: int) -> list[KVEntry]:
    """The entries every process of a concurrency test writes in round ``round_`` (the same keys in all)."""
    return [small_entry([round_, i, *range(64)]) for i in range(HAMMER_ENTRIES)]


def same_kv(a: KVEntry, b: KVEntry) -> bool:
    return (
        a.key == b.key
        and a.token_ids == b.token_ids
        and torch.equal(a.k, b.k)
        and torch.equal(a.v, b.v)
        and a.fingerprint == b.fingerprint
    )


def split_entry_bytes(data: bytes) -> tuple[dict, bytes]:
    """(header dict, payload) of encoded entry bytes (for crafting damaged files)."""
    (length,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    return json.loads(data[start : start + length]), data[start + length :]


def join_entry_bytes(header: dict, payload: bytes, reseal: bool = True) -> bytes:
    """Encoded bytes from a header and payload; ``reseal`` recomputes both checksums (a well-formed file)."""
    if reseal:
        header = dict(header, payload_sha256=hashlib.sha256(payload).hexdigest())
        body = {k: v for k, v in header.items() if k != "header_sha256"}
        header["header_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<Q", len(raw)) + raw + payload


def save_tiny_checkpoint(folder: Path, tokenizer, family: str = "llama", seed: int = 0) -> Path:
    """A loadable HF checkpoint folder (tiny random model + the SmolLM2 tokenizer) for ``--model PATH``."""
    model = tiny_hf_model(family, len(tokenizer), seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``semkv <argv>`` in this process: (exit code, stdout, stderr); argparse exits become codes."""
    from semkv.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def run_processes(procs, timeout: float = 120.0) -> None:
    """Start every process, wait for all, kill stragglers; each must exit 0."""
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * len(procs), f"a process failed: exit codes {codes}"
