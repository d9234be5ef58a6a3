"""The router's backends: health, load (requests in flight through this router), and the choice of one.

Choice: the ring's owner of the request's affinity key, unless sending it there would leave the owner
more than ``max_imbalance`` requests in flight beyond the least-loaded live backend; then the next
backend on the ring for which it would not (bounded-load consistent hashing, so a hot key spills over
instead of queueing), and if none, the least-loaded (ring order breaks ties). ``max_imbalance=1``: a
backend gets the request only while no other has fewer in flight — least-loaded, with the key's owner
preferred among the least loaded; 0: least-loaded alone. A request without a key goes to the
least-loaded live backend. A backend that failed its health check, or
refused a connection, is skipped until ``/health`` answers again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from semkv.route.ring import HashRing

log = logging.getLogger(__name__)


@dataclass
class Backend:
    """url: base URL (``http://host:port``); up: last health check (or connection) succeeded;
    in_flight: requests sent and not finished; routed: requests sent in total."""

    url: str
    up: bool = True
    in_flight: int = 0
    routed: int = 0
    failures: int = 0
    last_error: str | None = None

    def summary(self) -> dict[str, object]:
        return {
            "url": self.url,
            "up": self.up,
            "in_flight": self.in_flight,
            "routed": self.routed,
            "failures": self.failures,
            "last_error": self.last_error,
        }


class BackendPool:
    """Backends on a hash ring; used from the event loop only (no locks needed)."""

    def __init__(self, urls: list[str], vnodes: int = 256, max_imbalance: int = 1) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.backends = [Backend(url) for url in urls]
        self.by_url = {b.url: b for b in self.backends}
        self.ring = HashRing(urls, vnodes)
        self.max_imbalance = max_imbalance

    def live(self) -> list[Backend]:
        return [b for b in self.backends if b.up]

    def candidates(self, key: str | None) -> tuple[list[Backend], str]:
        """Backends to try, best first, and why the first was chosen: "affinity" (the key's ring owner),
        "balanced" (the owner was too loaded) or "least_loaded" (no key). Backends marked down come last."""
        live = self.live()
        down = [b for b in self.backends if not b.up]
        if not live:
            return down, "least_loaded"
        if key is None:
            return sorted(live, key=lambda b: (b.in_flight, b.routed)) + down, "least_loaded"
        ring = [self.by_url[url] for url in self.ring.order(key)]
        ring_live = [b for b in ring if b.up]
        least = min(b.in_flight for b in live)
        fits = [b for b in ring_live if b.in_flight + 1 - least <= self.max_imbalance]
        first = fits[0] if fits else min(ring_live, key=lambda b: b.in_flight)  # min: the first of the least
        reason = "affinity" if first is ring_live[0] else "balanced"
        return [first] + [b for b in ring_live if b is not first] + down, reason

    def mark(self, backend: Backend, up: bool, error: str | None = None) -> None:
        """Record a health check or a connection outcome; logs transitions."""
        if up and not backend.up:
            log.warning("backend %s is up again", backend.url)
        elif not up and backend.up:
            log.warning("backend %s is down (%s); skipped until /health answers", backend.url, error)
        if not up:
            backend.failures += 1
            backend.last_error = error
        backend.up = up
