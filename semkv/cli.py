"""The ``semkv`` command: demo, generate, bench, serve, route, cache, calibrate."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from semkv.config import default_home
from semkv.models.precision import COMPUTE_DTYPE_CHOICES


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2-135m", help="embedded model name or local HF checkpoint folder"
    )
    p.add_argument(
        "--home", default=None, help="semkv home folder (converted models, disk store); env SEMKV_HOME"
    )
    p.add_argument("--kv-dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device: cpu (tested) or cuda (checked by `semkv bench gpu`, see README status)",
    )
    p.add_argument(
        "--compute-dtype",
        default="auto",
        choices=list(COMPUTE_DTYPE_CHOICES),
        help="dtype of the model's matmuls and attention (auto: bfloat16 where the CPU has AVX512-BF16/AMX)",
    )
    p.add_argument(
        "--no-pack-weights",
        action="store_true",
        help="no oneDNN-packed copy of the weights (bf16 on CPU): half the weight memory, slower decode",
    )
    p.add_argument(
        "--no-keep-freed-memory",
        action="store_true",
        help="leave glibc's malloc settings alone: freed big blocks go back to the OS (the first prefills of "
        "a process up to ~1.4x slower, a smaller resident heap afterwards); serve: no restart with "
        "MALLOC_ARENA_MAX=1",
    )
    p.add_argument(
        "--page-pool-mib",
        type=_non_negative_int,
        default=None,
        help="size of the page pool, the hot tier of exact prefix KV on the device, in MiB "
        "(default 1024; 0: no pool)",
    )


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _engine(args: argparse.Namespace):
    from semkv.engine import Engine

    return Engine.from_args(args)


def _budget(text: str) -> float | int:
    """A kv_budget from the command line: a fraction ("0.1") or a token count ("512")."""
    try:
        return int(text) if text.isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction or a token count, got {text!r}") from None


def _read_text_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from semkv.request import GenerateRequest

    chunks = [_read_text_file(p) for p in args.chunk_file]
    options = dict(
        prompt=args.prompt,
        chunks=chunks,
        max_new_tokens=args.max_new_tokens,
        reuse=args.reuse,
        temperature=args.temperature,
        sparse=None if args.sparse == "dense" else args.sparse,
        kv_budget=args.kv_budget,
        sparse_reselect_every=args.sparse_reselect_every,
    )
    GenerateRequest(**options)  # bad input fails here, before the model loads
    engine = _engine(args)
    try:
        g = engine.generate(**options)
    finally:
        engine.close()  # records the store's hit counters for `semkv cache stats`
    print(g.text)
    print(json.dumps({k: v for k, v in g.stats.items()}, indent=2, default=str), file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from semkv.demo import run_demo

    run_demo(_engine(args), scenes=args.scene)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)


def cmd_cache(args: argparse.Namespace) -> int:
    from semkv.store.cache_admin import cache_command

    home = Path(args.home).expanduser() if args.home else default_home()
    result = cache_command(args.action, home)
    print(json.dumps(result, indent=2))
    return 1 if result.get("damaged") else 0


def _server_missing(package: str | None) -> int:
    print(
        f"semkv: error: serve needs {package}, which is not installed (pip install fastapi uvicorn)",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    from semkv import calibrate
    from semkv.bench import add_bench_parsers
    from semkv.route import command as route_command

    try:
        from semkv.server import command as serve_command
    except ModuleNotFoundError as exc:  # the server's packages are missing: every other command still runs
        serve_command, server_missing = None, exc.name

    parser = argparse.ArgumentParser(prog="semkv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run the main job on the embedded defaults")
    _add_engine_args(p)
    p.add_argument("--scene", action="append", default=None, help="run only this scene (repeatable)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--chunk-file", action="append", default=[], help="a context document (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reuse", default="auto")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--sparse",
        default="auto",
        help="sparse decode policy: auto (the calibrated profile's best; dense without one), dense, or a "
        "policy name (keykey, quest, ...)",
    )
    p.add_argument(
        "--kv-budget",
        type=_budget,
        default=None,
        help="sparse decode budget: a fraction of the context (0, 1] or a token count (default: calibrated)",
    )
    p.add_argument(
        "--sparse-reselect-every",
        type=int,
        default=None,
        metavar="K",
        help="sparse decode: choose the attended blocks at most every K decode steps (1: every step; "
        "default: the decoder's, 4)",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="run an evaluation suite (JSON + Markdown + plots)")
    add_bench_parsers(p, _add_engine_args)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("cache", help="inspect or clear the store")
    p.add_argument("action", choices=["stats", "clear", "verify"])
    p.add_argument("--home", default=None)
    p.set_defaults(func=cmd_cache)

    if serve_command is not None:
        serve_command.add_parser(sub, _add_engine_args)
    else:
        # takes any arguments (no option is parsed: prefix_chars matches none) and says what is missing
        p = sub.add_parser(
            "serve", help=f"unavailable: {server_missing} is not installed", prefix_chars="\x01"
        )
        p.add_argument("ignored", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda _: _server_missing(server_missing))
    route_command.add_parser(sub)
    calibrate.add_parser(sub, _add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the process's own command line (a command may restart the process with it), or None when called
    # with an argument list (in-process use: never restarted)
    args.command_line = list(sys.argv[1:]) if argv is None else None
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # bad input or an unusable file/folder: a message, no traceback
        print(f"semkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
