"""``semkv serve``: run the OpenAI-compatible server on an engine."""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from semkv.config import STORE_SECRET_ENV
from semkv.host_memory import restart_with_one_arena
from semkv.server.warmup import warm_up

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_WARMUP_TOKENS = 600  # more than one chunk of the default 512-token chunked prefill, and a remainder
DEFAULT_DISK_MB = 10 * 1024  # serve's disk tier budget: ~46 KB per prompt token would fill a disk


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
    p.add_argument(
        "--sync-store-writes",
        action="store_true",
        help="write the disk and Redis tiers on the engine thread (default: on a background thread, so "
        "fsyncs and Redis round trips do not stall the running streams)",
    )
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
        "--warmup-tokens",
        type=int,
        default=DEFAULT_WARMUP_TOKENS,
        help="before taking traffic, run one request of about this many prompt tokens so the first user does "
        "not pay the process's one-time costs (0: no warm-up)",
    )
    p.add_argument(
        "--disk-mb",
        type=int,
        default=DEFAULT_DISK_MB,
        help=f"byte budget of the disk tier, MiB; the oldest entries are removed past it "
        f"(default {DEFAULT_DISK_MB}; 0 = unbounded)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="API keys, one 'KEY TENANT [shared,metrics]' per line; clients send 'Authorization: Bearer KEY' "
        "and tenants never share cached KV or documents (default: one anonymous tenant, no keys)",
    )
    p.add_argument(
        "--store-secret",
        default=None,
        metavar="SECRET",
        help=f"sign every stored entry (disk, Redis) with this secret; unsigned entries are misses "
        f"(default ${STORE_SECRET_ENV}; prefer the environment: a flag is visible in the process list)",
    )
    p.add_argument(
        "--debug-stats",
        action="store_true",
        help="return every engine stat in responses, including those about other requests' cached data "
        "(which path reused what, share references, refusal reasons); trusted clients only",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=8,
        help="sequences decoding together, one batched forward per step (1: one request at a time)",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        help="tokens one engine step computes (prompt tokens + one per decoding sequence); a longer full "
        "prefill goes in chunks between decode steps",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill every prompt in one piece (running streams wait for the whole prefill)",
    )
    p.add_argument(
        "--max-live-kv-mb",
        type=int,
        default=None,
        help="KV memory the running sequences may hold (decode arena included), MiB; admission waits beyond"
        " it (default unbounded)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a request not finished this long after it arrived (queue + prefill + decode) ends with a 504 "
        "(default 300)",
    )
    p.add_argument(
        "--max-body-mb", type=float, default=32.0, help="largest request body accepted, MiB (default 32)"
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection that has not sent its request headers this long after it opened (or after its "
        "last response) is closed (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request body not received whole this long after its headers is a 408 (default 60)",
    )
    p.add_argument(
        "--max-documents-per-tenant",
        type=int,
        default=1024,
        help="documents one tenant may have uploaded (0: no limit; default 1024); beyond: 429",
    )
    p.add_argument(
        "--max-document-tokens-per-tenant",
        type=int,
        default=4_000_000,
        help="document tokens one tenant may have uploaded (0: no limit; default 4,000,000); beyond: 429",
    )
    p.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.disk_mb < 0:
        raise ValueError(f"--disk-mb must be >= 0 (0 = unbounded), got {args.disk_mb}")
    if args.warmup_tokens < 0:
        raise ValueError(f"--warmup-tokens must be >= 0 (0 = no warm-up), got {args.warmup_tokens}")
    if (
        getattr(args, "command_line", None) is not None
        and not args.no_keep_freed_memory
        and args.device == "cpu"
    ):
        # the engine thread's allocations go to the main arena, whose freed memory is kept: restart with
        # MALLOC_ARENA_MAX=1 (no return where glibc would restart; see semkv.host_memory), after the flag
        # checks (a bad flag fails at once) and before the server's imports (not done twice)
        restart_with_one_arena(args.command_line)
    import uvicorn

    from semkv.config import SchedulerConfig, StoreConfig
    from semkv.engine import Engine
    from semkv.server.app import ServerConfig, create_app
    from semkv.server.auth import APIKeys
    from semkv.server.http import header_timeout_protocol

    config = ServerConfig(
        model_name=args.served_model_name,
        defaults=dict(args.default),
        max_queue=args.max_queue,
        api_keys=APIKeys.from_file(args.api_keys) if args.api_keys else None,
        debug_stats=args.debug_stats,
        request_timeout_s=args.request_timeout,
        max_body_bytes=int(args.max_body_mb * 1024**2),
        body_timeout_s=args.body_timeout,
        max_documents_per_tenant=args.max_documents_per_tenant or None,
        max_document_tokens_per_tenant=args.max_document_tokens_per_tenant or None,
    )
    http = header_timeout_protocol(args.header_timeout)
    scheduler = SchedulerConfig(
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_waiting=args.max_queue,
        max_live_kv_bytes=None if args.max_live_kv_mb is None else args.max_live_kv_mb * 1024**2,
        chunked_prefill=not args.no_chunked_prefill,
    )
    store = StoreConfig(
        memory_bytes=args.memory_mb * 1024**2,
        disk=not args.no_disk,
        disk_bytes=args.disk_mb * 1024**2 if args.disk_mb else None,
        redis_url=args.redis,
        redis_timeout_s=args.redis_timeout,
        redis_namespace=args.redis_namespace,
        redis_wait_replicas=args.redis_wait,
        secret=args.store_secret or os.environ.get(STORE_SECRET_ENV) or None,
        write_behind=not args.sync_store_writes,
    )
    if config.api_keys is not None:
        log.warning("API keys on: %d keys, tenants %s", len(config.api_keys), sorted(config.api_keys.tenants))
    engine = on_a_thread_of_its_own(lambda: Engine.from_args(args, store=store, scheduler=scheduler))
    app = create_app(engine, config)
    if args.warmup_tokens:
        try:
            done = app.state.semkv.loop.run_job(lambda: warm_up(engine, args.warmup_tokens)).result()
            log.info("warm-up request of %d prompt tokens: %.2f s", done.prompt_tokens, done.seconds)
        except Exception as exc:  # serve anyway: the first request pays the start-up costs instead
            log.warning("the warm-up request failed, serving without it: %s", exc)
    log.warning("semkv serving %s on http://%s:%d", app.state.semkv.model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=http)
    finally:
        engine.close()
    return 0


def on_a_thread_of_its_own(build: Callable[[], T]) -> T:
    """``build()`` on a thread that ends before this returns (its result, or its exception re-raised).

    The model's start-up work (loading, converting) runs torch parallel regions; on the main thread they
    would leave an OpenMP worker pool alive for the server's whole life beside the engine thread's, and
    two live pools on a small machine slow every decode step (see
    :mod:`semkv.server.worker`). A pool dies with its thread."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = build()
        except BaseException as exc:  # re-raised on the calling thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="semkv-start")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
