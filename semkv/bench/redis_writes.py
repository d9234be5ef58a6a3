"""Redis tier writes: the cost of acknowledging each write with WAIT on a Redis Cluster with replicas.

Two tiers on the same cluster put fresh entries shaped like the model's KV (a prefix block of
``--block-size`` tokens and a document chunk of ``--chunk-tokens`` tokens; layers, KV heads and head
size from the model's config, ``--kv-dtype``): one with ``wait_replicas=0`` (SET only), one with
``wait_replicas=1`` (SET, then WAIT on the same connection until the master's replica holds it). The
two alternate write by write, so drift in the machine's load hits both alike; each entry is deleted
right after its timed write (untimed) so memory stays flat. Reported per entry size: median and p99
time per ``put`` (encode + SET [+ WAIT]), and the median difference = what WAIT costs per write.

Without ``--redis`` a throwaway 3-master + 3-replica cluster is started on loopback ports.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from semkv.bench.report import median, write_results
from semkv.config import KV_DTYPES, default_home
from semkv.store.entry import KVEntry
from semkv.store.keys import EntryKind, chunk_key
from semkv.store.redis_process import LocalRedisCluster
from semkv.store.redis_tier import RedisTier

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--redis", default=None, help="a Redis Cluster URL with replicas (default: start one locally)"
    )
    p.add_argument("--writes", type=int, default=200, help="timed writes per tier for block-size entries")
    p.add_argument("--chunk-writes", type=int, default=40, help="timed writes per tier for chunk entries")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens of a document chunk entry")
    p.add_argument("--redis-timeout", type=float, default=1.0, help="socket timeout of both tiers")
    p.add_argument("--seed", type=int, default=0)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


def kv_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of the model, read from its config."""
    from transformers import AutoConfig

    from semkv.models.loader import resolve_checkpoint

    home = Path(args.home).expanduser() if args.home else default_home()
    config = AutoConfig.from_pretrained(resolve_checkpoint(args.model, home, home / "models"))
    heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


def fresh_entry(shape: tuple[int, int, int], tokens: int, dtype: torch.dtype, g: torch.Generator) -> KVEntry:
    layers, heads, head_dim = shape
    ids = [int(t) for t in torch.randint(0, 50_000, (tokens,), generator=g)]
    k = torch.randn(layers, heads, tokens, head_dim, generator=g).to(dtype)
    v = torch.randn(layers, heads, tokens, head_dim, generator=g).to(dtype)
    return KVEntry(chunk_key("bench-" + "0" * 58, ids), EntryKind.CHUNK, "bench-" + "0" * 58, ids, k, v)


def timed_writes(
    tiers: dict[str, RedisTier],
    shape: tuple[int, int, int],
    tokens: int,
    n: int,
    dtype: torch.dtype,
    seed: int,
) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(seed)
    times: dict[str, list[float]] = {name: [] for name in tiers}
    for _ in tqdm(range(n), desc=f"{tokens}-token entries", leave=False):
        for name, tier in tiers.items():
            entry = fresh_entry(shape, tokens, dtype, g)
            start = time.perf_counter()
            acknowledged = tier.put(entry)
            times[name].append(time.perf_counter() - start)
            if not acknowledged:
                raise RuntimeError(f"a write of tier {name} was not acknowledged: {tier.stats}")
            tier.delete(entry.key)
    return times


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads or 1)
    shape = kv_shape(args)
    dtype = KV_DTYPES[args.kv_dtype]
    cluster = None
    if args.redis is None:
        cluster = LocalRedisCluster(
            Path(tempfile.mkdtemp(prefix="semkv-bench-redis-")), masters=3, replicas=1
        )
        cluster.start()
    url = args.redis or cluster.url  # type: ignore[union-attr]
    rows: list[dict[str, Any]] = []
    try:
        tiers = {
            "no WAIT": RedisTier(url, timeout_s=args.redis_timeout, namespace="benchnowait", wait_replicas=0),
            "WAIT 1": RedisTier(url, timeout_s=args.redis_timeout, namespace="benchwait", wait_replicas=1),
        }
        if not tiers["WAIT 1"].cluster:
            raise ValueError(f"{url} is not a Redis Cluster")
        for tokens, n in ((args.block_size, args.writes), (args.chunk_tokens, args.chunk_writes)):
            times = timed_writes(tiers, shape, tokens, n, dtype, args.seed + tokens)
            entry_bytes = (
                2 * shape[0] * shape[1] * shape[2] * tokens * torch.tensor([], dtype=dtype).element_size()
            )
            medians = {name: median(t) for name, t in times.items()}
            for name, t in times.items():
                rows.append(
                    {
                        "entry": f"{tokens} tokens ({entry_bytes / 1024:.0f} KiB of KV)",
                        "tier": name,
                        "writes": len(t),
                        "put_median_ms": 1000 * medians[name],
                        "put_p99_ms": 1000 * percentile(t, 99),
                        "wait_cost_median_ms": 1000 * (medians[name] - medians["no WAIT"]),
                        "ratio_to_no_wait": medians[name] / medians["no WAIT"],
                        "MB_per_s": entry_bytes / medians[name] / 1e6,
                    }
                )
        for tier in tiers.values():
            tier.close()
    finally:
        if cluster is not None:
            cluster.stop()
            shutil.rmtree(cluster.workdir, ignore_errors=True)
    config = {
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "kv_shape": shape,
        "redis": args.redis or "local 3+3",
    }
    config.update(
        {k: getattr(args, k) for k in ("block_size", "chunk_tokens", "writes", "chunk_writes", "seed")}
    )
    notes = "WAIT cost = median put time with WAIT 1 minus without (same cluster, writes alternating).\n"
    json_path, md_path = write_results(args.out, "redis_writes", rows, config, notes=notes)
    print(md_path.read_text())  # noqa: T201 - the bench's report on the terminal
    return 0
