"""Bad input through the Python API is a clear error naming the problem; nothing stored is lost.

Injected: 52 bad requests to ``Engine.generate`` (empty / whitespace / over-length prompts, a prompt
that leaves no room for max_new_tokens, absurd and mistyped max_new_tokens, unknown reuse modes,
out-of-range and non-numeric temperature / top_p / seed / recompute ratios, bytes and lone-surrogate
(non-UTF-8) text in the prompt, messages and chunks, malformed messages and chunks, unknown
options), bad engine settings (KV dtype, block size, threads, store sizes), 7 bad model folders
(unsupported architecture, no model_type, config not JSON / not an object, no config.json, a
missing path, a file) and 4 bad cache folders (the store folder is a file, a shard folder is a file,
junk files, an entry path that is a directory).

Must happen: each bad request raises ``ValueError`` (``TypeError`` for an unknown option) whose
message names the offending field or file; the store is unchanged by it (same files, same bytes);
the same engine then serves a good request with output identical to before. A bad model folder
fails before any weights load; a store folder that is a file fails at start naming the folder; a
damaged or junk-filled store keeps serving correct output.
"""

from __future__ import annotations

import json

import pytest
import torch

from semkv.config import StoreConfig
from semkv.engine import Engine
from semkv.request import GenerateRequest
from tests.conftest import tiny_hf_model
from tests.reliability.reliability_helpers import PROMPT, engine_at

LONG = "word " * 2100  # > 2048 positions of the tiny model

BAD_REQUESTS = [
    ({"prompt": ""}, "empty"),
    ({"prompt": "   \n\t "}, "empty"),
    ({"prompt": None}, "exactly one"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "exactly one"),
    ({"prompt": LONG}, "context"),
    ({"prompt": "word " * 2000, "max_new_tokens": 200}, "context"),
    ({"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": -5}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 10**12}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": 2.5}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": "16"}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": True}, "max_new_tokens"),
    ({"prompt": "hi", "max_new_tokens": None}, "max_new_tokens"),
    ({"prompt": "hi", "reuse": "bogus"}, "reuse mode"),
    ({"prompt": "hi", "reuse": None}, "reuse mode"),
    ({"prompt": "hi", "reuse": ""}, "reuse mode"),
    ({"prompt": "hi", "reuse": "PREFIX"}, "reuse mode"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ({"prompt": "hi", "temperature": float("inf")}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_p": float("nan")}, "top_p"),
    ({"prompt": "hi", "top_p": None}, "top_p"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "seed": "abc"}, "seed"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": b"hello"}, "bytes"),
    ({"prompt": bytearray(b"\xff\xfe")}, "bytes"),
    ({"prompt": "caf\udce9"}, "Unicode"),  # b"caf\xe9" decoded with surrogateescape: not UTF-8
    ({"prompt": "\ud800"}, "Unicode"),
    ({"prompt": 42}, "prompt"),
    ({"messages": [{"role": "user", "content": "ok\udcff"}]}, "Unicode"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "user"),
    ({"prompt": "hi", "chunks": "one string"}, "chunks"),
    ({"prompt": "hi", "chunks": [None]}, "chunks[0]"),
    ({"prompt": "hi", "chunks": ["fine", b"bytes"]}, "chunks[1]"),
    ({"prompt": "hi", "chunks": ["bad \udc80 text"]}, "chunks[0]"),
    ({"prompt": "hi", "chunks": 7}, "chunks"),
]
OPTIONAL_FIELD_REQUESTS = [  # fields other paths add to the request; tested when they exist
    ({"prompt": "hi", "recompute_ratio": -0.1}, "recompute_ratio"),
    ({"prompt": "hi", "recompute_ratio": 1.5}, "recompute_ratio"),
    ({"prompt": "hi", "recompute_ratio": "most"}, "recompute_ratio"),
    ({"prompt": "hi", "recompute_ratio": float("nan")}, "recompute_ratio"),
    ({"prompt": "hi", "share": "yes"}, "share"),
    ({"prompt": "hi", "sparse": "no-such-policy"}, "sparse"),
]
REQUEST_FIELDS = set(GenerateRequest.__dataclass_fields__)


@pytest.fixture(scope="module")
def served(tokenizer, tmp_path_factory):
    """An engine with a populated store, and its answer to PROMPT before any bad input."""
    home = tmp_path_factory.mktemp("bad-api")
    engine = engine_at(home, tokenizer)
    before = engine.generate(PROMPT, max_new_tokens=3)
    return engine, home, before


def store_snapshot(home):
    return {p.relative_to(home): p.read_bytes() for p in (home / "store").rglob("*") if p.is_file()}


def check_rejected(engine, home, request, needle, error=ValueError):
    snapshot = store_snapshot(home)
    entries = len(list(engine.store.memory.keys()))
    with pytest.raises(error) as info:
        engine.generate(**request)
    assert needle.lower() in str(info.value).lower(), f"error does not name the problem: {info.value}"
    assert store_snapshot(home) == snapshot and len(list(engine.store.memory.keys())) == entries


@pytest.mark.parametrize(("request_", "needle"), BAD_REQUESTS + OPTIONAL_FIELD_REQUESTS)
def test_bad_request_is_a_clear_error(served, request_, needle):
    engine, home, _ = served
    if not set(request_) <= REQUEST_FIELDS:
        pytest.skip(f"the request has no field {set(request_) - REQUEST_FIELDS} yet")
    check_rejected(engine, home, request_, needle)


def test_unknown_option_names_it(served):
    engine, home, _ = served
    check_rejected(engine, home, {"prompt": "hi", "max_tokens": 5}, "max_tokens", TypeError)


def test_service_continues_after_bad_input(served):
    engine, home, before = served
    for request_, _ in BAD_REQUESTS[:10]:
        with pytest.raises(ValueError):
            engine.generate(**request_)
    after = engine.generate(PROMPT, max_new_tokens=3)
    assert after.token_ids == before.token_ids and after.stats["reused_tokens"] > 0
    torch.testing.assert_close(after.first_logits, before.first_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"kv_dtype": "int8"}, "kv_dtype"),
        ({"kv_dtype": None}, "kv_dtype"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": "16"}, "block_size"),
        ({"block_size": 10**6}, "block_size"),
        ({"threads": 0}, "threads"),
        ({"threads": "2"}, "threads"),
        ({"memory_bytes": -1}, "memory_bytes"),
        ({"memory_bytes": "1GB"}, "memory_bytes"),
        ({"disk_bytes": 0}, "disk_bytes"),
        ({"redis_timeout_s": 0}, "redis_timeout_s"),
    ],
)
def test_bad_engine_settings(tmp_path, kwargs, needle):
    """Through ``Engine.from_pretrained``: settings are checked before the model loads."""
    store_keys = {"memory_bytes", "disk_bytes", "redis_timeout_s"}
    with pytest.raises(ValueError, match=needle):
        if set(kwargs) & store_keys:
            Engine.from_pretrained("smollm2-135m", home=tmp_path, store=StoreConfig(**kwargs))
        else:
            Engine.from_pretrained("smollm2-135m", home=tmp_path, **kwargs)
    assert not (tmp_path / "models").exists()  # nothing was loaded or converted


def write_model_folder(folder, config):
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("make", "error", "needle"),
    [
        (
            lambda d: write_model_folder(d / "m", {"model_type": "gpt2"}),
            ValueError,
            "unsupported model architecture 'gpt2'",
        ),
        (
            lambda d: write_model_folder(d / "m", {"hidden_size": 8}),
            ValueError,
            "unsupported model architecture",
        ),
        (lambda d: write_model_folder(d / "m", "{not json"), ValueError, "config.json"),
        (lambda d: write_model_folder(d / "m", "[1, 2]"), ValueError, "not a JSON object"),
        (lambda d: (d / "m").mkdir() or d / "m", FileNotFoundError, "no config.json"),
        (lambda d: d / "does-not-exist", FileNotFoundError, "does-not-exist"),
        (lambda d: (d / "f").write_text("x") and d / "f", FileNotFoundError, "config.json"),
    ],
    ids=["gpt2", "no-model-type", "not-json", "not-object", "no-config", "missing", "a-file"],
)
def test_bad_model_folder(tmp_path, make, error, needle):
    folder = make(tmp_path)
    with pytest.raises(error) as info:
        Engine.from_pretrained(str(folder), home=tmp_path / "home")
    assert needle in str(info.value)


def test_store_folder_that_is_a_file(tmp_path, tokenizer):
    (tmp_path / "store").write_bytes(b"precious")
    with pytest.raises(OSError, match="cache folder"):
        engine_at(tmp_path, tokenizer)
    assert (tmp_path / "store").read_bytes() == b"precious"


def test_junk_in_the_store_folder_is_ignored(tmp_path, tokenizer):
    """A shard folder that is a file, junk files, a directory named like an entry: still correct output."""
    model = tiny_hf_model("llama", len(tokenizer))
    ref = engine_at(tmp_path / "ref", tokenizer, model, disk=False).generate(
        PROMPT, max_new_tokens=3, reuse="none", store_prompt=False
    )
    home = tmp_path / "home"
    writer = engine_at(home, tokenizer, model)
    writer.generate(PROMPT, max_new_tokens=3)
    store = home / "store"
    shards = sorted(p for p in store.iterdir() if p.is_dir())
    victim = shards[0]
    for f in victim.iterdir():
        f.unlink()
    victim.rmdir()
    victim.write_bytes(b"a file where a shard folder was")
    (store / "README.txt").write_text("junk")
    (shards[1] / "notakey.skv").write_bytes(b"junk")
    (shards[1] / ("0" * 64 + ".skv.bak")).write_bytes(b"junk")
    (store / "zz").mkdir()
    (store / "zz" / ("z" * 64 + ".skv")).mkdir()

    engine = engine_at(home, tokenizer, model)
    for _ in range(2):
        g = engine.generate(PROMPT, max_new_tokens=3)
        assert g.token_ids == ref.token_ids
        torch.testing.assert_close(g.first_logits, ref.first_logits, atol=1e-5, rtol=0)
    assert engine.store.tier("disk").stats.errors >= 1  # the write into the blocked shard failed, quietly
    assert victim.read_bytes() == b"a file where a shard folder was"
    assert (store / "README.txt").read_text() == "junk"
