"""``semkv serve``: run the OpenAI-compatible server on an engine."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def parse_default(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value); VALUE is read as JSON when it parses (numbers, true, lists), else a string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def add_parser(subparsers: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, documents, /metrics)"
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="shared Redis tier: one node, redis://127.0.0.1:6379/0, or a Redis Cluster, "
        "redis://h1:p1,h2:p2/0 (seed nodes; any one node of it works too)",
    )
    p.add_argument("--redis-timeout", type=float, default=0.25, help="seconds per Redis call (default 0.25)")
    p.add_argument("--redis-namespace", default="semkv", help="prefix of this deployment's Redis keys")
    p.add_argument(
        "--redis-wait",
        type=int,
        default=None,
        metavar="N",
        help="replicas a Redis write must reach (WAIT) before it counts as stored "
        "(default: 1 if the deployment has replicas, else 0)",
    )
    p.add_argument("--models-dir", default=None, help="converted models folder (default <home>/models)")
    p.add_argument("--no-disk", action="store_true", help="no local disk tier (memory [+ Redis] only)")
    p.add_argument("--memory-mb", type=int, default=2048, help="byte budget of the memory tier, MiB")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument(
        "--default",
        action="append",
        default=[],
        type=parse_default,
        metavar="KEY=VALUE",
        help="engine option applied to every request unless it overrides it (repeatable), e.g. reuse=auto",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting or running before 429s")
    p.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from semkv.config import StoreConfig
    from semkv.engine import Engine
    from semkv.server.app import ServerConfig, create_app

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    config = ServerConfig(
        model_name=args.served_model_name,
        defaults=dict(args.default),
        max_queue=args.max_queue,
    )
    store = StoreConfig(
        memory_bytes=args.memory_mb * 1024**2,
        disk=not args.no_disk,
        redis_url=args.redis,
        redis_timeout_s=args.redis_timeout,
        redis_namespace=args.redis_namespace,
        redis_wait_replicas=args.redis_wait,
    )
    engine = Engine.from_args(args, store=store)
    app = create_app(engine, config)
    log.warning("semkv serving %s on http://%s:%d", app.state.semkv.model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
