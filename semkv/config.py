"""Configuration dataclasses and the semkv home folder.

Every setting a user can change lives in one of these dataclasses; they are
validated in ``__post_init__`` so a bad value fails where it is written, not deep
inside a forward pass.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from semkv.models.precision import COMPUTE_DTYPE_CHOICES, resolve_compute_dtype
from semkv.validation import check_bool

log = logging.getLogger(__name__)

KV_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def default_home() -> Path:
    """The semkv home folder: ``$SEMKV_HOME``, else ``$XDG_CACHE_HOME/semkv``, else ``~/.cache/semkv``."""
    if os.environ.get("SEMKV_HOME"):
        return Path(os.environ["SEMKV_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "semkv"


STORE_SECRET_ENV = "SEMKV_STORE_SECRET"
DEFAULT_PAGE_POOL_BYTES = 1 << 30  # EngineConfig.page_pool_bytes: 1 GiB


def _secret_from_env() -> str | None:
    return os.environ.get(STORE_SECRET_ENV) or None


def private_mkdir(path: Path) -> Path:
    """Create ``path`` and every missing parent with mode 0700 (``Path.mkdir(parents=True)`` gives the
    parents the default mode); existing folders are left as they are."""
    path = Path(path)
    missing = []
    for folder in [path, *path.parents]:
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
    return path


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) readable by this user only (0700); warn when an existing
    folder is open to others (it is left as it is: it may be shared on purpose)."""
    path = private_mkdir(Path(path))
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return path
    if mode & 0o077:
        log.warning(
            "the semkv home %s is open to other users (mode %o): cached prompts are readable there; "
            "chmod 700 it unless it is shared on purpose",
            path,
            mode,
        )
    return path


@dataclass
class StoreConfig:
    """Where and how KV entries are kept.

    memory_bytes: byte budget of the in-process LRU tier.
    disk: keep entries on local disk under ``<home>/store`` (write-through).
    disk_bytes: optional byte budget of the disk tier (oldest entries removed first); None = unbounded.
    redis_url: optional shared Redis tier: one node (``redis://host:port/db``) or a Redis Cluster
        (its seed nodes ``redis://h1:p1,h2:p2/0``, or any one node of it).
    redis_timeout_s: socket timeout for every Redis call; a slow Redis is a miss.
    redis_namespace: prefix of every Redis key (deployments sharing one Redis use different ones).
    redis_wait_replicas: replicas a Redis write must reach (WAIT) before it is acknowledged;
        None: 1 when the deployment has replicas, else 0.
    redis_max_value_bytes: entries larger than this are not written to Redis.
    secret: the deployment's store secret (default: ``$SEMKV_STORE_SECRET``): every entry written to
        disk or Redis is signed with it, and an entry without a valid signature is a miss.
    write_behind: write the disk and Redis tiers on a background thread (the memory tier at once;
        an entry not yet written is served from the queue), so fsyncs and network round trips do not
        stall the other streams of a batch; :meth:`KVStore.flush` waits for them, closing the store or
        the interpreter's exit writes what is queued. Off by default here (an entry is on disk when
        ``put`` returns, as a script running one engine after another expects); ``semkv serve`` turns
        it on (``--sync-store-writes`` keeps it off).
    write_behind_bytes: at most this many bytes of entries wait for the background writes; a write
        beyond that waits for room.
    """

    memory_bytes: int = 2 * 1024**3
    disk: bool = True
    disk_bytes: int | None = None
    redis_url: str | None = None
    redis_timeout_s: float = 0.25
    redis_namespace: str = "semkv"
    redis_wait_replicas: int | None = None
    redis_max_value_bytes: int = 64 * 1024**2
    secret: str | None = field(default_factory=_secret_from_env, repr=False)
    write_behind: bool = False
    write_behind_bytes: int = 512 * 1024**2

    def __post_init__(self) -> None:
        if not isinstance(self.write_behind, bool):
            raise ValueError(f"write_behind must be a bool, got {self.write_behind!r}")
        if (
            isinstance(self.write_behind_bytes, bool)
            or not isinstance(self.write_behind_bytes, int)
            or self.write_behind_bytes < 1
        ):
            raise ValueError(f"write_behind_bytes must be an int >= 1, got {self.write_behind_bytes!r}")
        if self.secret is not None and (not isinstance(self.secret, str) or len(self.secret) < 16):
            raise ValueError("secret must be a str of at least 16 characters (or None)")
        if isinstance(self.redis_max_value_bytes, bool) or not isinstance(self.redis_max_value_bytes, int):
            raise ValueError(f"redis_max_value_bytes must be an int, got {self.redis_max_value_bytes!r}")
        if self.redis_max_value_bytes < 1:
            raise ValueError(f"redis_max_value_bytes must be >= 1, got {self.redis_max_value_bytes}")
        for name in ("memory_bytes", "disk_bytes", "redis_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.memory_bytes is None or self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be >= 0, got {self.memory_bytes}")
        if self.disk_bytes is not None and self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be positive or None, got {self.disk_bytes}")
        if self.redis_timeout_s <= 0:
            raise ValueError(f"redis_timeout_s must be positive, got {self.redis_timeout_s}")
        if (
            not isinstance(self.redis_namespace, str)
            or not self.redis_namespace
            or any(c in self.redis_namespace for c in ":{}")
        ):
            raise ValueError(
                f"redis_namespace must be a non-empty string without ':', '{{', '}}', got {self.redis_namespace!r}"
            )
        wait = self.redis_wait_replicas
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int) or wait < 0):
            raise ValueError(f"redis_wait_replicas must be an int >= 0 or None, got {wait!r}")


@dataclass
class SchedulerConfig:
    """Limits of continuous batching (:class:`semkv.scheduler.Scheduler`).

    max_running: sequences decoding together (1 = one request at a time: batching off).
    max_batched_tokens: tokens one step may compute: one per decoding sequence plus prompt tokens.
        With ``chunked_prefill`` a full prefill longer than what is left goes in chunks over several
        steps (running streams wait at most one chunk); a reuse path's prefill (prefix, blend, share)
        runs in one piece, in a step of its own when it does not fit.
    chunked_prefill: split full prefills at the step's token budget (False: every prefill in one piece).
    max_waiting: requests queued before ``add_request`` refuses more (:class:`~semkv.scheduler.QueueFull`).
    max_live_kv_bytes: KV memory the live sequences may hold, as really allocated: the decode arena
        (every slot, free or not, at its full capacity, padding included) plus the caches outside it
        (each prompt + ``max_new_tokens`` rows). Admission waits while a request's cache does not fit
        (one starting in a free arena slot adds nothing); the arena grows, or shrinks, only within it
        (caches it has no room for decode on their own buffers). None = unbounded.
    """

    max_running: int = 8
    max_batched_tokens: int = 512
    max_waiting: int = 64
    max_live_kv_bytes: int | None = None
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"chunked_prefill must be True or False, got {self.chunked_prefill!r}")
        for name in ("max_running", "max_batched_tokens", "max_waiting", "max_live_kv_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_live_kv_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class EngineConfig:
    """How the engine runs a model.

    model: an embedded model name (``smollm2-135m``) or a local HF checkpoint folder.
    home: semkv home folder (converted models + disk tier); None = :func:`default_home`.
    models_dir: where embedded models are converted; None = ``<home>/models``. Several processes with
        their own ``home`` (own disk store) can share one converted copy through it.
    kv_dtype: dtype of KV at rest *and* in the live computation ("float16", "bfloat16", "float32").
    compute_dtype: dtype the model's matmuls and attention run in ("auto", "float32", "bfloat16",
        "float16"). "auto": bfloat16 where the device has fast bf16 (CPU: AVX512-BF16 / AMX), else
        float32. Entries stored under one compute dtype are never served to another.
    block_size: tokens per prefix block.
    threads: torch intra-op threads; None leaves torch's default.
    device: the torch device the model and its KV live on ("cpu", "cuda", "cuda:1", ...). "cpu" is
        tested; cuda: not yet verified by ``semkv bench gpu`` (CPU-only kernels sit behind a device
        check).
    scheduler: limits of continuous batching (``Engine.add_request`` / ``Engine.step``).
    pack_weights: keep a copy of every matrix packed once for oneDNN where the runtime computes in bf16 /
        fp16 on CPU (:mod:`semkv.models.linear`): the same bits as without and a faster decode, but the matrices'
        memory twice. False: plain ``F.linear``.
    keep_freed_memory: on CPU, make the C allocator (glibc) keep the memory the process frees for its next
        allocations rather than unmapping big blocks and faulting them in again on every prefill
        (:mod:`semkv.host_memory`; process-wide, like ``threads``; the main thread's arena, which
        ``semkv serve`` makes every thread's by restarting with ``MALLOC_ARENA_MAX=1``): a fresh process's
        first long prefills get faster, at the price of the process keeping its peak heap.
        False: glibc's defaults.
    page_pool_bytes: the page pool's size, the hot tier of exact prefix KV on the device
        (:mod:`semkv.models.page_pool`): a prefix hit on its pages is a bulk copy of rows already in the
        live cache's format. Bounded: least recently used pages are reused first. Its memory comes on
        top of ``scheduler.max_live_kv_bytes`` (it holds no live sequence's rows). 0: no pool (hits come
        from the store's memory tier).
    """

    model: str = "smollm2-135m"
    home: str | Path | None = None
    kv_dtype: str = "float16"
    block_size: int = 16
    threads: int | None = None
    store: StoreConfig = field(default_factory=StoreConfig)
    models_dir: str | Path | None = None
    device: str = "cpu"
    compute_dtype: str = "auto"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pack_weights: bool = True
    keep_freed_memory: bool = True
    page_pool_bytes: int = DEFAULT_PAGE_POOL_BYTES

    def __post_init__(self) -> None:
        check_bool("pack_weights", self.pack_weights)
        check_bool("keep_freed_memory", self.keep_freed_memory)
        if not isinstance(self.device, str):
            raise ValueError(f"device must be a str such as 'cpu' or 'cuda', got {self.device!r}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from None
        if self.compute_dtype not in COMPUTE_DTYPE_CHOICES:
            raise ValueError(
                f"compute_dtype must be one of {list(COMPUTE_DTYPE_CHOICES)}, got {self.compute_dtype!r}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size must be an int in [1, 4096], got {self.block_size!r}")
        if (
            isinstance(self.page_pool_bytes, bool)
            or not isinstance(self.page_pool_bytes, int)
            or self.page_pool_bytes < 0
        ):
            raise ValueError(f"page_pool_bytes must be an int >= 0, got {self.page_pool_bytes!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")
        self.home = Path(self.home).expanduser() if self.home is not None else default_home()
        self.models_dir = Path(self.models_dir).expanduser() if self.models_dir is not None else None

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        """The compute dtype on this config's device ("auto" resolved; warns if it is emulated there)."""
        return resolve_compute_dtype(self.compute_dtype, self.device)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def home_path(self) -> Path:
        assert isinstance(self.home, Path)
        return self.home

    @property
    def models_path(self) -> Path:
        return Path(self.models_dir) if self.models_dir is not None else self.home_path / "models"
