"""``semkv route`` as a subprocess on a free loopback port (used by ``semkv bench serve`` and the tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from semkv.processes import HTTPProcess, free_port


class RouteProcess(HTTPProcess):
    """``semkv route --backend URL ... --port PORT *extra``; ready when every backend is up."""

    def __init__(
        self,
        backends: Sequence[str],
        log_path: Path,
        *extra: str,
        port: int | None = None,
        cpus: Sequence[int] | None = None,
    ) -> None:
        port = port or free_port()
        self.backends = list(backends)
        cmd = [sys.executable, "-m", "semkv.cli", "route", "--port", str(port)]
        for url in self.backends:
            cmd += ["--backend", url]
        super().__init__(cmd + list(extra), port, log_path, "semkv route", cpus)

    def ready(self, response: httpx.Response) -> bool:
        return response.status_code == 200 and response.json().get("backends_up") == len(self.backends)
