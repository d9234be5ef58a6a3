"""Server fixtures: an app over a tiny random-weight engine, clients, and ``semkv serve`` subprocesses.

The apps and servers here run with ``debug_stats`` (``--debug-stats``) unless a test passes its own
config: these tests check which path served a request and how much it reused, which a server only
tells trusted clients (``tests/server/test_tenants.py`` checks what the default hides)."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn
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
        return create_app(engine, config or ServerConfig(debug_stats=True))

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
        c = TestClient(
            create_app(engine, config or ServerConfig(debug_stats=True)), raise_server_exceptions=False
        )
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
            model,
            home,
            "--served-model-name",
            name,
            "--threads",
            "1",
            "--debug-stats",
            *extra,
            log_path=log_path,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop(timeout=15)


@pytest.fixture
def live_server(tiny_app):
    """start(config=None, app=None) -> base URL of a uvicorn server over a tiny app (or ``app``), on a free
    loopback port, in a thread (so a test can reach it with raw sockets and read its app's state)."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(config: ServerConfig | None = None, app=None) -> str:
        app = app if app is not None else tiny_app(config)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
