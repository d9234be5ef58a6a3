"""``semkv serve`` as a subprocess on a free loopback port (used by ``semkv bench serve`` and the tests)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from semkv.processes import HTTPProcess, free_port

__all__ = ["ServeProcess", "free_port"]


class ServeProcess(HTTPProcess):
    """``semkv serve --model MODEL --home HOME --port PORT *extra``; output goes to ``log_path``.

    port: 0 or None picks a free one. cpus: cores to pin the server to (taskset), None: unpinned.
    remove_home: :meth:`stop` deletes ``home`` (a throwaway home, e.g. a benchmark's), unless the server
    had exited on its own with an error: then its home and log are kept for a look.

    Call :meth:`wait_ready` before use and :meth:`stop` when done.
    """

    def __init__(
        self,
        model: str | Path,
        home: Path,
        *extra: str,
        port: int | None = None,
        log_path: Path | None = None,
        cpus: Sequence[int] | None = None,
        remove_home: bool = False,
    ) -> None:
        port = port or free_port()
        self.home = Path(home)
        self.remove_home = remove_home
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "semkv.cli", "serve", "--model", str(model), "--home", str(self.home)]
        cmd += ["--port", str(port), *extra]
        super().__init__(cmd, port, log_path or self.home / "serve.log", "semkv serve", cpus)

    def stop(self, timeout: float = 20.0) -> None:
        """Terminate the server (see :meth:`HTTPProcess.stop`); with ``remove_home``, delete its home unless
        it had crashed before."""
        crashed = self.proc.poll() not in (None, 0)
        super().stop(timeout)
        if self.remove_home and not crashed:
            shutil.rmtree(self.home, ignore_errors=True)
