"""Child processes serving HTTP on loopback ports (``semkv serve``, ``semkv route``), for tests and benches.

Nothing here imports the server or the engine, so the router's helpers stay light.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx


class LoopbackPorts:
    """Hands out loopback TCP ports nobody listens on, never the same one twice in a row of ``memory``.

    A port is free when it is handed out, but the child that will listen on it binds it later: a second
    ask in between could be given the same port by the kernel (two backends of one test then shared a
    URL). This remembers the last ``memory`` ports it handed out and asks the kernel again for those."""

    def __init__(self, memory: int = 4096) -> None:
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        self._memory = memory
        self._handed_out: dict[int, None] = {}  # insertion-ordered: the oldest is forgotten first
        self._lock = threading.Lock()

    @property
    def remembered(self) -> tuple[int, ...]:
        """The ports still remembered, oldest first."""
        with self._lock:
            return tuple(self._handed_out)

    def take(self, attempts: int = 100) -> int:
        """A port not listened on now and not handed out recently; OSError after ``attempts`` tries."""
        with self._lock:
            for _ in range(attempts):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                if port not in self._handed_out:
                    self._handed_out[port] = None
                    if len(self._handed_out) > self._memory:
                        del self._handed_out[next(iter(self._handed_out))]
                    return port
        raise OSError(f"no loopback port that was not handed out recently after {attempts} tries")


_PORTS = LoopbackPorts()


def free_port() -> int:
    """A loopback TCP port nobody listens on right now, not handed out before by this process (recently:
    see :class:`LoopbackPorts`), so children started one after the other never share one."""
    return _PORTS.take()


def pinned(cmd: list[str], cpus: Sequence[int] | None) -> list[str]:
    """``cmd`` run under ``taskset -c CPUS`` (pinned to those cores); unchanged when ``cpus`` is None."""
    if cpus is None:
        return cmd
    if not cpus or any(c < 0 for c in cpus):
        raise ValueError(f"cpus must be a non-empty list of core numbers, got {list(cpus)}")
    taskset = shutil.which("taskset")
    if taskset is None:
        raise OSError("taskset (util-linux) is needed to pin a process to cores")
    return [taskset, "-c", ",".join(str(c) for c in cpus), *cmd]


class HTTPProcess:
    """A child process answering HTTP on ``127.0.0.1:port``; its output goes to ``log_path``.

    cpus: cores to pin the process to (taskset), None to leave it to the scheduler.
    Call :meth:`wait_ready` before use and :meth:`stop` when done.
    """

    def __init__(
        self, cmd: list[str], port: int, log_path: Path, name: str, cpus: Sequence[int] | None = None
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.name = name
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(pinned(cmd, cpus), stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def ready(self, response: httpx.Response) -> bool:
        """Whether a ``/health`` answer means the process is ready (default: a 200)."""
        return response.status_code == 200

    def wait_ready(
        self, timeout: float = 120.0, ready: Callable[[httpx.Response], bool] | None = None
    ) -> None:
        """Poll ``/health`` until ``ready`` accepts it; raise with the log's tail if the process exits or times out."""
        check = ready or self.ready
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if check(httpx.get(f"{self.url}/health", timeout=1.0)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        """The last 4,000 characters of the process's output."""
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
