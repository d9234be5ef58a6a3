"""Server fixtures: an app over a tiny random-weight engine, clients, and ``semkv serve`` subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from semkv.server import ServerConfig, create_app

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
        engine_config = EngineConfig(model="llama", home=home, kv_dtype="float32", block_size=4)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiny_checkpoint(tmp_path, make_tiny_engine):
    """The tiny random llama of ``make_tiny_engine`` saved as a local HF checkpoint (with the SmolLM2
    tokenizer), for ``semkv serve`` subprocesses."""
    engine = make_tiny_engine("llama")
    folder = tmp_path / "tiny-ckpt"
    engine.hf_model.save_pretrained(folder)
    engine.tokenizer.save_pretrained(folder)
    return folder


class ServeProcess:
    """``semkv serve`` in a subprocess on a free loopback port, with its own home (own disk store)."""

    def __init__(self, model: str | Path, home: Path, *extra: str, name: str = TINY) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.log_path = home.parent / f"{home.name}-serve.log"
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "semkv.cli", "serve", "--model", str(model), "--home", str(home)]
        cmd += ["--port", str(self.port), "--served-model-name", name, "--threads", "1", *extra]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"semkv serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"semkv serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def serve_process():
    """serve_process(model, home, *args) -> a started ServeProcess (waited for by the caller); stopped after."""
    started: list[ServeProcess] = []

    def start(model, home, *extra, name=TINY) -> ServeProcess:
        proc = ServeProcess(model, home, *extra, name=name)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
