"""``semkv serve`` as a subprocess on a free loopback port (used by ``semkv bench serve`` and the tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from semkv.processes import HTTPProcess, free_port

__all__ = ["ServeProcess", "free_port"]


class ServeProcess(HTTPProcess):
    """``semkv serve --model MODEL --home HOME --port PORT *extra``; output goes to ``log_path``.

    port: 0 or None picks a free one. cpus: cores to pin the server to (taskset), None: unpinned.

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
    ) -> None:
        port = port or free_port()
        self.home = Path(home)
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "semkv.cli", "serve", "--model", str(model), "--home", str(self.home)]
        cmd += ["--port", str(port), *extra]
        super().__init__(cmd, port, log_path or self.home / "serve.log", "semkv serve", cpus)
