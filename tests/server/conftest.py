"""Server fixtures: an app over a tiny random-weight engine, clients, and ``semkv serve`` subprocesses."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig, create_app
from semkv.server.process import ServeProcess

TINY = "tiny"


@pytest.fixture
def tiny_app(make_tiny_engine):
    """make(config=None, **engine) -> a FastAPI app serving a tiny llama engine named "tiny"."""

    def make(config: ServerConfig | None = None, **engine_kwargs):
        engine = make_tiny_engine("llama", **engine_kwargs)
        engine.name = TINY
        return create_app(engine, config or ServerConfig())

    return make


@pytest.fixture(scope="module")
def module_client_factory(tmp_path_factory, tokenizer, tiny_model_factory):
    """make(config=None) -> a TestClient over a tiny app shared by a whole test module (the server
    must keep serving across every test of the module); closed at the module's end."""
    from semkv.config import EngineConfig
    from semkv.engine import Engine

    clients: list[TestClient] = []

    def make(config: ServerConfig | None = None) -> TestClient:
        home = tmp_path_factory.mktemp("module-home")
        engine_config = EngineConfig(
            model="llama", home=home, kv_dtype="float32", block_size=4, compute_dtype="float32"
        )
        engine = Engine(engine_config, tiny_model_factory("llama", len(tokenizer)), tokenizer, name=TINY)
        c = TestClient(create_app(engine, config or ServerConfig()), raise_server_exceptions=False)
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(tiny_app):
    """A TestClient over a fresh tiny app; 5xx come back as responses, never as exceptions."""
    with TestClient(tiny_app(), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def tiny_checkpoint(tmp_path, make_tiny_engine):
    """The tiny random llama of ``make_tiny_engine`` saved as a local HF checkpoint (with the SmolLM2
    tokenizer), for ``semkv serve`` subprocesses."""
    engine = make_tiny_engine("llama")
    folder = tmp_path / "tiny-ckpt"
    engine.hf_model.save_pretrained(folder)
    engine.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def serve_process():
    """serve_process(model, home, *args) -> a started ServeProcess (waited for by the caller); stopped after."""
    started: list[ServeProcess] = []

    def start(model, home, *extra, name=TINY) -> ServeProcess:
        log_path = home.parent / f"{home.name}-serve.log"
        proc = ServeProcess(
            model, home, "--served-model-name", name, "--threads", "1", *extra, log_path=log_path
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop(timeout=15)
