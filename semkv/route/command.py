"""``semkv route``: run the cache-aware router in front of several ``semkv serve`` backends."""

from __future__ import annotations

import argparse
import logging
from typing import Any

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "route",
        help="cache-aware router over several semkv serve backends (OpenAI-compatible passthrough)",
    )
    p.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="a semkv serve base URL, e.g. http://10.0.0.2:8000 (repeat for each backend)",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=256,
        help="leading prompt characters hashed to pick a backend (about the first blocks)",
    )
    p.add_argument(
        "--max-imbalance",
        type=int,
        default=1,
        help="requests in flight a backend may have beyond the least-loaded one (counting the new request) "
        "before its keys spill over; 1 (default): least-loaded, the key's owner first among equals",
    )
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health polls")
    p.add_argument("--health-timeout", type=float, default=1.0, help="seconds a /health poll may take")
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for a backend's next bytes")
    p.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from semkv.route.app import RouterConfig, create_router_app

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    config = RouterConfig(
        backends=args.backend,
        prefix_chars=args.prefix_chars,
        max_imbalance=args.max_imbalance,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        read_timeout_s=args.timeout,
    )
    logging.getLogger("semkv.route").setLevel(args.log_level.upper())
    app = create_router_app(config)
    log.warning("semkv routing to %s on http://%s:%d", ", ".join(config.backends), args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
