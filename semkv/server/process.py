"""``semkv serve`` as a subprocess on a free loopback port (used by ``semkv bench serve`` and the tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``semkv serve --model MODEL --home HOME --port PORT *extra``; output goes to ``log_path``.

    port: 0 or None picks a free one.

    Call :meth:`wait_ready` before use and :meth:`stop` when done.
    """

    def __init__(
        self,
        model: str | Path,
        home: Path,
        *extra: str,
        port: int | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path or self.home / "serve.log"
        cmd = [sys.executable, "-m", "semkv.cli", "serve", "--model", str(model), "--home", str(self.home)]
        cmd += ["--port", str(self.port), *extra]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll ``/health`` until it answers 200; raise with the log's tail if the process exits or times out."""
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
        """The last 4,000 characters of the server's output."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate (kill after ``timeout`` seconds) and close the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
