"""The request pipeline, as public steps: prefill -> decode -> store -> finish.

A request goes through:

1. :meth:`Engine.resolve` — the request resolved once (a :class:`~semkv.request.ResolvedRequest`): its
   prompt as tokenized segments (template, chunks, body, suffix), its reuse and sparse options after the
   engine's defaults, its namespace and prefix block keys; tokenized off the engine's lock, on a private
   copy of the tokenizer, after its text's length was checked against the model's context;
2. :meth:`Engine.plan` — every reuse path is asked for an offer (``semkv/reuse/``); the one that
   reuses most is chosen, the others' refusals are kept;
3. :meth:`Engine.prefill` — a live cache is filled by the chosen path, the first token sampled:
   a :class:`~semkv.sequence.Sequence`;
4. :meth:`Engine.decode_step` / :meth:`Engine.decode` — one or many decode steps (dense, or through
   the request's sparse decoder);
5. :meth:`Engine.store_prefill` — what the prefill made reusable (prefix blocks, chunks, the prompt for
   sharing) goes to the store; done after the first token, so it is not in TTFT;
6. :meth:`Engine.finish` — the :class:`~semkv.request.Generation` (text, token ids, stats).

:meth:`Engine.generate` composes them for one request. Many requests at once go through the
scheduler (``semkv/scheduler.py``): :meth:`Engine.add_request`, then :meth:`Engine.step` until every
request has finished, each step admitting and prefilling waiting requests and decoding the running ones
by one token in one batched forward (:meth:`Engine.decode_batch`); :meth:`Engine.abort` ends one.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from semkv.config import (
    DEFAULT_PAGE_POOL_BYTES,
    EngineConfig,
    SchedulerConfig,
    StoreConfig,
    make_private_dir,
)
from semkv.host_memory import keep_freed_memory
from semkv.loop_repair import repair
from semkv.models.loader import load_model, model_fingerprint
from semkv.models.registry import adapter_for
from semkv.models.runtime import Runtime
from semkv.profile import EngineDefaults, check_request, defaults_from_profile, find_profile
from semkv.prompt import PromptLayout, build_layout, tokenize_text
from semkv.request import AnyRequest, GenerateRequest, Generation, ResolvedRequest
from semkv.reuse.base import Plan, PrefillContext, PrefillOutcome, Refusal, ReusePath, TailPrefillPath
from semkv.reuse.blend import add_chunks
from semkv.reuse.options import BlendConfig
from semkv.reuse.prefix import PrefixKeys
from semkv.reuse.registry import FULL, build_paths
from semkv.scheduler import Admission, Scheduler, StepOutput
from semkv.sequence import PrefillJob, Sequence, TokenCallback, row_maxima
from semkv.sparse.base import SparsePolicy
from semkv.sparse.decoder import SparseDecoder
from semkv.sparse.index import BlockIndex, capture_prefill_queries
from semkv.sparse.session import decoder_for
from semkv.store.entry import KVShape
from semkv.store.keys import EntryKey, Namespace
from semkv.store.store import KVStore
from semkv.text_stream import TextStream
from semkv.tokenizer_pool import TokenizerPool, max_chars_per_token

if TYPE_CHECKING:
    from semkv.store.redis_tier import RedisTier

log = logging.getLogger(__name__)

SHARE_INDEX_DIR = "share_index"
TOKENIZER_COPIES = 2  # requests tokenized at once off the engine thread (each on its own tokenizer copy)


class Engine:
    """A model, its runtime, its KV store and its reuse paths.

    Thread-safe: the public steps hold one re-entrant lock, so model work runs on one thread at a time;
    ``add_request`` and ``abort`` may be called from any thread while another one calls ``step``.
    :meth:`resolve` (tokenizing a request) holds no engine lock: it runs on a private copy of the
    tokenizer from :attr:`tokenizers`, from any thread, beside a step.
    ``defaults`` holds what unset request knobs fall back to (the calibrated profile, if any).
    The home folder is created readable by its user only (0700): it holds cached prompts.
    """

    def __init__(
        self, config: EngineConfig, hf_model: torch.nn.Module, tokenizer: Any, name: str = ""
    ) -> None:
        self.config = config
        self.name = name or config.model
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if config.keep_freed_memory and config.torch_device.type == "cpu":
            keep_freed_memory()
        compute_dtype = config.torch_compute_dtype
        # the runtime runs a private copy in the compute dtype if hf_model is in another one
        self.runtime = Runtime(
            adapter_for(hf_model.config.model_type)(hf_model, pack_weights=config.pack_weights),
            config.torch_kv_dtype,
            compute_dtype,
        )
        self.adapter = self.runtime.adapter
        self.fingerprint = model_fingerprint(hf_model, tokenizer, config.torch_kv_dtype, compute_dtype)
        make_private_dir(config.home_path)
        shape = KVShape(self.adapter.num_layers, self.adapter.num_kv_heads, self.adapter.head_dim)
        self.store = KVStore.from_config(config.store, config.home_path, self.fingerprint, shape)
        if config.page_pool_bytes:
            self.runtime.attach_page_pool(config.block_size, config.page_pool_bytes)
        self.ctx = PrefillContext(self.runtime, self.store, self.fingerprint, config.block_size, tokenizer)
        self.paths: dict[str, ReusePath] = build_paths(self.share_index_folder())
        # defaults measured by `semkv calibrate` for this fingerprint (the user's, else the shipped one)
        self.defaults: EngineDefaults = defaults_from_profile(
            find_profile(config.home_path, self.fingerprint)
        )
        self.max_context = int(self.adapter.max_positions)
        self.tokenizers = TokenizerPool(tokenizer, TOKENIZER_COPIES)
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.eos_ids = frozenset(self._eos_ids())
        self.hook_errors: dict[str, int] = {}  # path name -> post-prefill hooks that raised
        self._lock = threading.RLock()
        self.scheduler: Scheduler[Sequence, PrefillJob] = Scheduler(self, config.scheduler)

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m",
        *,
        home: str | Path | None = None,
        kv_dtype: str = "float16",
        block_size: int = 16,
        threads: int | None = None,
        store: StoreConfig | None = None,
        models_dir: str | Path | None = None,
        device: str = "cpu",
        compute_dtype: str = "auto",
        scheduler: SchedulerConfig | None = None,
        pack_weights: bool = True,
        keep_freed_memory: bool = True,
        page_pool_bytes: int = DEFAULT_PAGE_POOL_BYTES,
    ) -> Engine:
        """Load an embedded model by name (converted once into ``home``, or ``models_dir``) or a local HF
        checkpoint folder, onto ``device`` (any torch device; "cpu" by default)."""
        config = EngineConfig(
            model=model,
            home=home,
            kv_dtype=kv_dtype,
            block_size=block_size,
            threads=threads,
            store=store or StoreConfig(),
            models_dir=models_dir,
            device=device,
            compute_dtype=compute_dtype,
            scheduler=scheduler or SchedulerConfig(),
            pack_weights=pack_weights,
            keep_freed_memory=keep_freed_memory,
            page_pool_bytes=page_pool_bytes,
        )
        make_private_dir(config.home_path)
        loaded = load_model(config.model, config.home_path, config.models_path, config.torch_device)
        return cls(config, loaded.hf_model, loaded.tokenizer, name=loaded.name)

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> Engine:
        """An engine from the standard CLI flags (``--model --home --kv-dtype --block-size --threads``,
        and ``--models-dir`` / ``--device`` / ``--compute-dtype`` / ``--no-pack-weights`` /
        ``--no-keep-freed-memory`` where a command has them); ``overrides`` replace or add keyword arguments."""
        options: dict[str, Any] = {
            "home": args.home,
            "kv_dtype": args.kv_dtype,
            "block_size": args.block_size,
            "threads": args.threads,
            "models_dir": getattr(args, "models_dir", None),
            "device": getattr(args, "device", None) or "cpu",
            "compute_dtype": getattr(args, "compute_dtype", None) or "auto",
            "pack_weights": not getattr(args, "no_pack_weights", False),
            "keep_freed_memory": not getattr(args, "no_keep_freed_memory", False),
        }
        pool_mib = getattr(args, "page_pool_mib", None)
        if pool_mib is not None:
            options["page_pool_bytes"] = int(pool_mib) << 20
        options.update(overrides)
        return cls.from_pretrained(args.model, **options)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.hf_model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(x) for x in source)
        return ids

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    # -- what other modules read of the engine (they never reach into ctx / runtime / store / config) --
    @property
    def home(self) -> Path:
        """The engine's home folder (cached prompts, profiles, converted models)."""
        return self.config.home_path

    @property
    def block_size(self) -> int:
        """Tokens per KV block (prefix reuse, sparse selection)."""
        return self.config.block_size

    @property
    def kv_dtype(self) -> str:
        """The dtype KV is stored in, by name ("float16", ...)."""
        return self.config.kv_dtype

    @property
    def compute_dtype(self) -> str:
        """The dtype the runtime computes in, by name ("float32", "bfloat16", ...)."""
        return str(self.runtime.compute_dtype).removeprefix("torch.")

    @property
    def store_secret(self) -> bytes | None:
        """The deployment's store secret (UTF-8), or None: what signs records shared through the store."""
        secret = self.config.store.secret
        return None if secret is None else secret.encode("utf-8")

    def redis_tier(self) -> RedisTier | None:
        """The store's Redis tier (its health, its records), or None when the store has none."""
        from semkv.store.redis_tier import RedisTier

        tier = self.store.tier("redis")
        return tier if isinstance(tier, RedisTier) else None

    def store_for_metrics(self) -> KVStore:
        """The KV store, to read its counters at a metrics scrape (stats, tiers, write-behind queue)."""
        return self.store

    def delete_stored(self, keys: list[str]) -> None:
        """Remove these entries (chunk keys, block keys) from every tier of the store and from the page
        pool."""
        with self._lock:
            pool = self.runtime.page_pool
            for key in keys:
                self.store.delete(key)
                if pool is not None:
                    pool.table.forget(key)

    def wait_stored(self, keys: list[str], timeout_s: float | None = None) -> bool:
        """Wait until these entries (e.g. a document's chunk keys from :meth:`add_chunks`) are in every
        tier of the store, not only queued for the tiers below memory; False on timeout. Does not hold
        the engine's lock: call it off the engine thread, which goes on meanwhile."""
        return self.store.wait_written(keys, timeout_s)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's row takes in a live cache (every layer: pre-RoPE keys in the KV dtype,
        rotated keys and values in the compute dtype)."""
        return self.runtime.kv_bytes_per_token()

    def compute_model(self) -> torch.nn.Module:
        """The HF model in the dtype the runtime computes in (the runtime's own cast copy, or the loaded
        model): for comparisons against HF's forward on the same weights."""
        return self.runtime.adapter.hf_model

    def empty_memory_tier(self) -> int:
        """Write every queued entry to the tiers below memory, then drop the memory tier's unpinned
        entries, so the next hits come from disk or Redis; returns how many were dropped. The page pool
        above it is emptied too (:meth:`drop_page_pool`)."""
        with self._lock:
            self.drop_page_pool()
            self.store.flush()
            memory = self.store.memory
            if memory is None:
                return 0
            dropped = 0
            for key in list(memory.keys()):
                if memory.pin_count(key) == 0:
                    memory.delete(key)
                    dropped += 1
            return dropped

    def drop_page_pool(self) -> int:
        """Forget every page of the page pool (pages a plan holds stay until loaded); returns how many
        keys were forgotten. The next hits come from the store's tiers."""
        with self._lock:
            pool = self.runtime.page_pool
            if pool is None:
                return 0
            forgotten = len(pool.table.page_of)
            pool.table.clear()
            return forgotten

    def page_pool_stats(self) -> dict[str, int]:
        """The page pool's size and use: pages, page tokens, pages indexed (cached or held), pages held by
        a plan, evictions so far, bytes allocated ({} without a pool)."""
        pool = self.runtime.page_pool
        if pool is None:
            return {}
        table = pool.table
        return {
            "pages": table.num_pages,
            "page_tokens": pool.block_size,
            "indexed": len(table.page_of),
            "held": sum(1 for refs in table.refs if refs > 0),
            "evictions": table.evictions,
            "bytes": pool.nbytes(),
        }

    def tier_hits(self, name: str) -> int | None:
        """Hits counted so far by the store tier ``name`` ("memory", "disk", "redis"); None without it."""
        tier = self.store.tier(name)
        return None if tier is None else tier.stats.hits

    @torch.inference_mode()
    def decode_logits(self, seq: Sequence, token_id: int) -> Tensor:
        """The runtime's decode step alone: append ``token_id`` to the sequence's cache and return the
        logits [V], with no sampling, stop check or repair (e.g. to check a GPU step for host syncs)."""
        with self._lock:
            return self.runtime.decode(seq.cache, token_id, self._start_sparse(seq))

    def twin(self, **changes: Any) -> Engine:
        """Another engine over the same weights and tokenizer, its config changed by ``changes``
        (e.g. ``compute_dtype="bfloat16"``)."""
        return Engine(replace(self.config, **changes), self.hf_model, self.tokenizer, self.name)

    def share_index_folder(self) -> Path | None:
        """``<home>/share_index/<fingerprint[:16]>`` when the store keeps a disk tier, else None (the
        share path's index then lives in memory only)."""
        if not self.config.store.disk:
            return None
        return self.config.home_path / SHARE_INDEX_DIR / self.fingerprint[:16]

    # -- resolving & planning ---------------------------------------------------------------------
    @property
    def max_prompt_chars(self) -> int:
        """Characters of user text (prompt or messages, chunks, reply start) a request may carry: the
        model's context times :attr:`max_chars_per_token` (the tokenizer's longest token string, see
        :func:`semkv.tokenizer_pool.max_chars_per_token`). A longer text is known to exceed the context
        before it is tokenized."""
        return self.max_context * self.max_chars_per_token

    def check_text_length(self, request: GenerateRequest) -> None:
        """A ValueError naming the limit if ``request``'s text cannot fit in the model's context (checked
        in characters, before any tokenization)."""
        chars = request.text_chars()
        if chars > self.max_prompt_chars:
            raise ValueError(
                f"the request's text has {chars} characters; at most {self.max_prompt_chars} fit in the "
                f"model's context of {self.max_context} tokens ({self.max_chars_per_token} characters per "
                "token at most)"
            )

    def resolve(self, request: AnyRequest, *, fit_context: bool = False) -> ResolvedRequest:
        """``request`` resolved once (a :class:`ResolvedRequest` is returned as it is): its text's length
        checked, its prompt tokenized, its reuse and sparse options resolved with the engine's defaults,
        its prefix block keys. ``fit_context``: a ``max_new_tokens`` the caller left to the engine is
        lowered to the room the prompt leaves in the context (at least 1). A ValueError if the prompt is
        empty or does not fit. Holds no engine lock: tokenizes on a private tokenizer copy, so it runs
        on any thread beside the engine's steps."""
        if isinstance(request, ResolvedRequest):
            return request
        self.check_text_length(request)
        with self.tokenizers.borrow() as tokenizer:
            layout = build_layout(
                tokenizer,
                request.prompt,
                request.messages,
                request.chunks,
                request.use_chat_template,
                request.assistant_prefix,
            )
        token_ids = tuple(layout.token_ids)
        if not token_ids:
            raise ValueError("prompt is empty after tokenization")
        if fit_context:
            request.max_new_tokens = max(1, min(request.max_new_tokens, self.max_context - len(token_ids)))
        if len(token_ids) + request.max_new_tokens > self.max_context:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens + max_new_tokens {request.max_new_tokens} exceeds the "
                f"model's context of {self.max_context} tokens"
            )
        check_request(self.defaults, request)  # warns below the calibrated profile
        options = self.defaults.reuse_options(request)
        policy, kv_budget, sparse_notes, sparse_config = self.defaults.resolve_sparse(request, len(token_ids))
        block = self.ctx.block_size
        keys: tuple[EntryKey, ...] = ()
        if options.mode != "none" and "prefix" in self.paths:
            # computed once, kept with the layout for the prefix path's plan and store
            keys = PrefixKeys.of_layout(self.fingerprint, block, layout, options.namespace).keys
        return ResolvedRequest(
            request=request,
            layout=layout,
            token_ids=token_ids,
            options=options,
            sparse_policy=policy,
            kv_budget=kv_budget,
            sparse_notes=sparse_notes,
            sparse_config=sparse_config,
            prefix_keys=keys,
            block_size=block,
        )

    def layout(self, request: AnyRequest) -> PromptLayout:
        """The request's prompt as tokenized segments (:meth:`resolve`); a ValueError if it is empty or
        too long."""
        return self.resolve(request).layout

    def plan(self, request: AnyRequest) -> tuple[Plan, list[Refusal]]:
        """Pick the prefill path: under "auto" the one that reuses most; an explicit mode, or an exact
        prefix hit when it reuses more (exact reuse is always allowed); "none" is full prefill.
        Returns the plan and the refusals of the paths asked."""
        resolved = self.resolve(request)
        options, layout = resolved.options, resolved.layout
        with self._lock:
            if options.mode == "none":
                return self.paths[FULL].plan(self.ctx, options, layout), []
            if options.mode == "auto":
                names = [name for name in self.paths if name != FULL]
            else:
                names = [options.mode] + (["prefix"] if options.mode != "prefix" else [])
            best: Plan | None = None
            refusals: list[Refusal] = []
            for name in names:
                offer = self.paths[name].plan(self.ctx, options, layout)
                if isinstance(offer, Refusal):
                    refusals.append(offer)
                elif best is None or offer.reused_tokens > best.reused_tokens:
                    best = offer
            if best is None:
                best = self.paths[FULL].plan(self.ctx, options, layout)
            return best, refusals

    # -- the steps -----------------------------------------------------------------------------------
    def prefill(self, request: AnyRequest, *, capture_queries: bool = False) -> Sequence:
        """Resolve and plan ``request``, fill a live cache through the chosen path and sample the first
        token. ``capture_queries`` keeps the prompt's queries (needed to :meth:`fork` into SnapKV/H2O).
        The TTFT (``seq.ttft_s``) covers planning, prefill and the first token; nothing is stored yet.
        :meth:`begin_prefill` + :meth:`advance_prefill` + :meth:`complete_prefill` in one go."""
        resolved = self.resolve(request)  # before the lock: tokenizing does not hold up other steps
        with self._lock:
            job = self.begin_prefill(resolved, capture_queries=capture_queries)
            self.advance_prefill(job)
            return self.complete_prefill(job)

    def begin_prefill(self, request: AnyRequest, *, capture_queries: bool = False) -> PrefillJob:
        """Plan ``request`` (resolved first if it is not) and make its live cache; nothing is computed
        yet."""
        resolved = self.resolve(request)
        with self._lock:
            start = time.perf_counter()
            plan, refusals = self.plan(resolved)
            period = resolved.request.sparse_reselect_every
            sparse = self.sparse_decoder(
                resolved.sparse_policy,
                resolved.kv_budget,
                **resolved.sparse_config,
                **({} if period is None else {"reselect_every": period}),
            )
            return PrefillJob(
                request=resolved.request,
                options=resolved.options,
                layout=resolved.layout,
                plan=plan,
                refusals=refusals,
                cache=self.runtime.new_cache(
                    self.runtime.request_capacity(resolved.prompt_tokens, resolved.max_new_tokens),
                    claim_slot=True,
                ),
                sparse=sparse,
                kv_budget=resolved.kv_budget,
                capture=capture_queries or (sparse is not None and sparse.policy.needs_prefill_queries),
                started=start,
                tail_prefill=isinstance(self.paths[plan.path], TailPrefillPath),
                notes=dict(resolved.sparse_notes),
            )

    def advance_prefill(self, job: PrefillJob, max_tokens: int | None = None) -> int:
        """Compute up to ``max_tokens`` more prompt tokens of ``job`` (None: all that is left); returns the
        tokens computed. A job whose path loads reused leading rows and prefills the rest exactly (full
        prefill, prefix reuse) goes in pieces when it has no query capture (``job.chunkable``): the first
        piece loads the reused rows, each piece's queries attend to every row before them. Blend and share
        run their plan in one piece: their recompute selects rows layer by layer over the whole prompt."""
        with self._lock:
            if job.done:
                return 0
            if job.chunkable:
                return self._advance_tail(job, max_tokens)
            if job.capture:
                with capture_prefill_queries(job.cache) as queries:
                    job.outcome = self.paths[job.plan.path].prefill(self.ctx, job.plan, job.cache)
                job.queries = queries
                if job.sparse is not None:
                    job.sparse.prefill = queries
            else:
                job.outcome = self.paths[job.plan.path].prefill(self.ctx, job.plan, job.cache)
            take, job.computed = len(job.layout) - job.computed, len(job.layout)
            return take

    def _advance_tail(self, job: PrefillJob, max_tokens: int | None) -> int:
        """One piece of a chunkable job: its path's reused rows first (once), then up to ``max_tokens``
        prompt tokens through the runtime; the outcome once the last token is in."""
        path = self.paths[job.plan.path]
        assert isinstance(path, TailPrefillPath)
        if job.loaded is None:
            job.loaded = path.load(self.ctx, job.plan, job.cache)
            job.computed = job.plan.reused_tokens
        take = job.remaining if max_tokens is None else min(job.remaining, max(1, max_tokens))
        logits = self.runtime.prefill(job.cache, job.layout.token_ids[job.computed : job.computed + take])
        job.computed += take
        job.chunks += 1
        if job.computed == len(job.layout):
            job.outcome = job.loaded.outcome(path.name, job.plan, logits, prefill_chunks=job.chunks)
        return take

    def complete_prefill(self, job: PrefillJob) -> Sequence:
        """The prefilled job as a :class:`Sequence` with its first token sampled."""
        if job.outcome is None:
            raise ValueError(f"the prefill is not complete: {job.remaining} prompt tokens left")
        outcome = job.outcome
        # The first token needs no block summaries, dense or sparse (it comes from the prefill's logits):
        # they are computed with the store after it (a noticeable part of a blend's TTFT), when a fork
        # needs them, or before a sparse request's first sparse decode step (_start_sparse), which also sets
        # its decoder up then (summaries and the policy's preparation: a sparse request's TTFT is a dense
        # one's).
        blocks, summarise_s = self._summarise(job.cache, outcome, now=job.capture and job.sparse is None)
        seq = Sequence(
            request=job.request,
            options=job.options,
            layout=job.layout,
            plan=job.plan,
            refusals=job.refusals,
            outcome=outcome,
            cache=job.cache,
            sparse=job.sparse,
            generator=self.runtime.generator(job.request.seed),
            eos_ids=self.eos_ids,
            kv_budget=job.kv_budget,
            prefill_queries=job.queries,
            blocks=blocks,
            summarise_s=summarise_s,
            notes={**self._fallback_note(job.options.mode, outcome.path, job.refusals), **job.notes},
        )
        seq.sample(outcome.logits)
        seq.ttft_s = time.perf_counter() - job.started
        return seq

    def _summarise(self, cache, outcome: PrefillOutcome, now: bool = True) -> tuple[BlockIndex, float]:
        """The block summaries of a freshly prefilled cache: those the reused blocks carried, the rest
        computed from the rows, now (``now``: a sparse decode then starts with every prompt block
        summarised) or later by :meth:`_summarise_prompt` (a dense request: after its first token; the
        carried ones are kept aside till then, and never inserted if nothing needs them).
        Returns the index and the seconds spent (part of the TTFT)."""
        start = time.perf_counter()
        blocks = BlockIndex(cache, self.config.block_size)
        blocks.insert_later(outcome.stored_summaries)
        if now:
            self._insert_carried(blocks)
            blocks.add_blocks()
        outcome.summaries = blocks
        return blocks, time.perf_counter() - start

    @staticmethod
    def _insert_carried(blocks: BlockIndex) -> None:
        try:
            blocks.insert_pending()
        except ValueError as exc:  # stored by another version: summarise the rows instead
            log.warning("recomputing block summaries: %s", exc)

    def _summarise_prompt(self, seq: Sequence) -> None:
        """Summarise the prompt blocks a dense request's prefill left for later (before its prompt is
        stored or it is forked): the reused blocks' carried summaries, the rest from the rows; the
        seconds are added to ``seq.summarise_s``."""
        if seq.blocks is None:
            return
        prompt_blocks = len(seq.layout) // self.config.block_size
        if seq.blocks.num_complete < prompt_blocks:
            start = time.perf_counter()
            self._insert_carried(seq.blocks)
            seq.blocks.add_blocks(prompt_blocks)
            seq.summarise_s += time.perf_counter() - start

    def sparse_decoder(
        self, policy: str | SparsePolicy | None, kv_budget: float | int, **config: Any
    ) -> SparseDecoder | None:
        """A sparse decoder for this engine's model (its window layers attend to their window), or None
        for dense decoding. ``config``: further :class:`~semkv.sparse.decoder.SparseConfig` fields."""
        windows = tuple(self.adapter.window(layer) for layer in range(self.adapter.num_layers))
        config.setdefault("layer_windows", windows)
        return decoder_for(policy, kv_budget, self.config.block_size, **config)

    @staticmethod
    def _fallback_note(mode: str, path: str, refusals: list[Refusal]) -> dict[str, Any]:
        """Say why an explicitly requested mode did not serve the request."""
        if mode in ("auto", "none", path):
            return {}
        reason = next((r.reason for r in refusals if r.path == mode), None)
        if path == "prefix":
            why = reason or "it reused fewer tokens"
            return {"fallback": f"reuse={mode!r} was outdone by an exact prefix hit ({why})"}
        return {"fallback": f"reuse={mode!r} refused: {reason}; served by {path}"}

    @torch.inference_mode()
    def decode_step(self, seq: Sequence, feed: int | None = None) -> Tensor:
        """One decode step: feed the sequence's last token (or ``feed`` in its place: teacher forcing),
        sample the next one into ``seq.tokens``; returns the step's logits [V]. Untimed, no stop check."""
        with self._lock:
            if feed is not None:
                seq.tokens[-1] = int(feed)
            logits = self.runtime.decode(seq.cache, seq.tokens[-1], self._start_sparse(seq))
            seq.sample(logits)
            if feed is None:
                self.repair_loop(seq)
            return logits

    @torch.inference_mode()
    def decode_batch(self, seqs: list[Sequence]) -> Tensor:
        """One decode step of several sequences in one batched forward (norms, projections, MLP and
        lm_head over all rows; attention per sequence over its own cache and sparse decoder). Each
        sequence samples its next token with its own settings; the step's time adds to every
        sequence's ``decode_s``. Returns the logits [B, V]. Untimed per token, no stop check.

        A sequence's failure is its own: when its sparse selection, its sampling or its loop repair
        raises, the exception goes to its ``failure`` (it samples nothing more; the scheduler ends it with
        that error) and the step goes on for the others (a selection that raised leaves that sequence
        attending to every row for the rest of the step: rows do not mix, so the others' logits are what
        they would have been)."""
        with self._lock:
            start = time.perf_counter()
            started = [self._start_sparse_alone(seq) for seq in seqs]
            ready = [ok for ok, _ in started]
            guards = [None if decoder is None else SelectionGuard(decoder) for _, decoder in started]
            logits = self.runtime.decode_batch(
                [seq.cache for seq in seqs],
                [seq.tokens[-1] for seq in seqs],
                list(guards),
                kv_limit=self.scheduler.config.max_live_kv_bytes,
            )
            maxima = row_maxima(logits)
            for seq, guard, row, maximum, ok in zip(seqs, guards, logits, maxima, ready, strict=True):
                if not ok:
                    continue
                if guard is not None and guard.error is not None:
                    self._fail_sequence(seq, guard.error, "its sparse selection")
                    continue
                try:
                    seq.sample(row, maximum)
                    self.repair_loop(seq)
                except Exception as exc:
                    self._fail_sequence(seq, exc, "sampling or loop repair")
            elapsed = time.perf_counter() - start
            for seq in seqs:
                seq.decode_s += elapsed
            return logits

    def _start_sparse(self, seq: Sequence) -> SparseDecoder | None:
        """What this decode step of ``seq`` attends through: its sparse decoder once set up, else None
        (every row). Sets the decoder up before its first sparse step (after its ``dense_steps`` dense
        ones): summarises the prompt's blocks (those its reused blocks carried, the rest from the rows)
        and attaches it (the policy prepares: e.g. the query probe's choice). The time goes to the step
        that calls it, never to the first token."""
        decoder = seq.sparse
        if decoder is None:
            return None
        if decoder.index is None:
            decoded = len(seq.tokens) - 1  # decode steps so far (the first token came with the prefill)
            if seq.blocks is None or decoded < decoder.config.dense_steps:
                return None
            self._summarise_prompt(seq)
            decoder.attach(seq.blocks)
        return decoder

    def _start_sparse_alone(self, seq: Sequence) -> tuple[bool, SparseDecoder | None]:
        """:meth:`_start_sparse` for one sequence of a batched step: (True, what it attends through), or
        (False, None) if its set-up raised (the sequence failed alone: it decodes densely in this step and
        samples nothing)."""
        try:
            return True, self._start_sparse(seq)
        except Exception as exc:
            self._fail_sequence(seq, exc, "its sparse set-up")
            seq.sparse = None
            return False, None

    @staticmethod
    def _fail_sequence(seq: Sequence, exc: BaseException, where: str) -> None:
        """Record what ended ``seq`` alone in a batched step (logged; the scheduler ends it)."""
        seq.failure = exc
        log.warning(
            "a sequence failed in %s (%s: %s); the other sequences of the step go on",
            where,
            type(exc).__name__,
            exc,
            exc_info=not isinstance(exc, ValueError),
        )

    def repair_loop(self, seq: Sequence) -> bool:
        """If ``seq``'s answer (decoded from inexact reused KV) has started to repeat itself, recompute its
        reused rows exactly and roll the repetition back (:mod:`semkv.loop_repair`, once per sequence;
        ``seq.notes["loop_repair"]`` says what it did). True if it repaired. Called after every decode step."""
        with self._lock:
            return seq.wants_loop_repair() and repair(self.runtime, seq)

    def decode(
        self, seq: Sequence, *, max_steps: int | None = None, on_token: TokenCallback | None = None
    ) -> list[int]:
        """Decode until the sequence finishes (max_new_tokens, EOS, or ``on_token`` returning False) or
        ``max_steps`` steps; each kept token goes to ``on_token`` as soon as it is sampled. Returns the
        tokens this call sampled; the time spent adds to ``seq.decode_s``."""
        with self._lock:
            seq.emit_pending(on_token)
            start = time.perf_counter()
            before = len(seq.tokens)
            steps = 0
            while not seq.finished and (max_steps is None or steps < max_steps):
                self.decode_step(seq)
                steps += 1
                seq.emit_pending(on_token)
            seq.decode_s += time.perf_counter() - start
            return seq.tokens[before:]

    def store_prefill(self, seq: Sequence) -> float:
        """Keep what the prefill made reusable (each path's ``after_prefill``: prefix blocks, chunks,
        the prompt for sharing), unless the request said ``store_prompt=False``. Once per sequence;
        returns the seconds spent.

        A hook that raises (a full disk under the share index, a tier bug) never fails the request:
        it is logged and counted in :attr:`hook_errors`, and the other hooks still run."""
        with self._lock:
            if seq.stored or not seq.request.store_prompt:
                return 0.0
            start = time.perf_counter()
            self._summarise_prompt(seq)
            for name, path in self.paths.items():
                try:
                    path.after_prefill(self.ctx, seq.options, seq.layout, seq.cache, seq.outcome)
                except Exception as exc:
                    self.hook_errors[name] = self.hook_errors.get(name, 0) + 1
                    log.error(
                        "storing after prefill failed in path %r (%s: %s); the request goes on",
                        name,
                        type(exc).__name__,
                        exc,
                        exc_info=exc,
                    )
            seq.stored = True
            seq.store_s = time.perf_counter() - start
            return seq.store_s

    def finish(self, seq: Sequence) -> Generation:
        """Close the sequence's sparse bookkeeping and return its :class:`Generation`."""
        if seq.sparse is not None:
            seq.sparse.finish()
        generated = seq.output_ids()
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        return Generation(text=text, token_ids=generated, stats=seq.stats(), first_logits=seq.first_logits)

    def fork(
        self,
        seq: Sequence,
        *,
        sparse: str | SparsePolicy | SparseDecoder | None = None,
        kv_budget: float | int | None = None,
    ) -> Sequence:
        """An independent copy of ``seq`` (cache, tokens, sampler state) decoding with another sparse
        policy: a policy name or object (with ``kv_budget``, else the sequence's budget), a ready
        :class:`SparseDecoder`, or None for dense. Measurements decode several policies from one
        prefilled cache this way. SnapKV / H2O need the prefill's queries (``prefill(capture_queries=True)``)."""
        with self._lock:
            budget = seq.kv_budget if kv_budget is None else kv_budget
            if isinstance(sparse, SparseDecoder):
                decoder: SparseDecoder | None = sparse
            else:
                decoder = self.sparse_decoder(sparse, budget)
            if decoder is not None and decoder.policy.needs_prefill_queries:
                if seq.prefill_queries is None:
                    raise ValueError(
                        f"sparse policy {decoder.policy.name!r} needs the prompt's queries: prefill with "
                        "capture_queries=True"
                    )
                decoder.prefill = seq.prefill_queries
            generator = self.runtime.generator(0)  # its state is set next
            generator.set_state(seq.generator.get_state())
            self._summarise_prompt(seq)
            cache = self.runtime.track(copy.deepcopy(seq.cache))
            blocks = seq.blocks.copy(cache) if seq.blocks is not None else None
            if decoder is not None and blocks is not None:
                decoder.attach(blocks)
            return replace(
                seq,
                cache=cache,
                blocks=blocks,
                sparse=decoder,
                generator=generator,
                kv_budget=budget,
                tokens=list(seq.tokens),
                decode_s=0.0,
                stored=True,  # the original stores what the prefill made reusable
                notes=dict(seq.notes),
            )

    # -- many requests: the scheduler -----------------------------------------------------------------
    def add_request(
        self,
        request: AnyRequest | None = None,
        *,
        request_id: str | None = None,
        timeout_s: float | None = None,
        waited_s: float = 0.0,
        **options: Any,
    ) -> str:
        """Queue a request (a :class:`GenerateRequest` or a :class:`ResolvedRequest`, or its fields as keyword
        arguments) for :meth:`step`; returns its id. The request is resolved here (:meth:`resolve`, on
        the calling thread, without the engine's lock): a ValueError if its prompt is empty or does not
        fit. ``timeout_s``: it ends with ``DeadlineExceeded`` after that many seconds from its arrival,
        ``waited_s`` seconds ago. Raises ``QueueFull`` when the scheduler's waiting queue is full.
        Thread-safe."""
        if request is None:
            request = GenerateRequest(**options)
        elif options:
            raise ValueError("give a GenerateRequest or its fields, not both")
        return self.scheduler.add_request(
            self.resolve(request), request_id=request_id, timeout_s=timeout_s, waited_s=waited_s
        )

    def step(self) -> list[StepOutput]:
        """One scheduler step: admit and prefill waiting requests, decode every running sequence by one
        token in one batched forward; returns what each request produced (new tokens and text, or its
        end with a finish reason and its :class:`Generation`)."""
        with self._lock:
            return self.scheduler.step()

    def abort(self, request_id: str) -> bool:
        """End a queued or running request at the next step (its output says "abort"). Thread-safe."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Requests are waiting or running in the scheduler."""
        return self.scheduler.has_unfinished()

    def admission(self, request: AnyRequest) -> Admission:
        """What admitting ``request`` costs the scheduler: prompt tokens, and its live cache's prompt +
        ``max_new_tokens`` rows and their bytes; the chained keys of its full prompt blocks in its cache
        namespace when it may reuse a stored prefix (none under ``reuse="none"`` or without the prefix
        path): read from its :class:`ResolvedRequest`. A ValueError if the prompt is empty or too long."""
        resolved = self.resolve(request)
        rows = resolved.prompt_tokens + resolved.max_new_tokens
        return Admission(
            resolved.prompt_tokens,
            rows * self.runtime.kv_bytes_per_token(),
            rows,
            resolved.prefix_keys,
            resolved.block_size,
        )

    def cached_prompt_tokens(self, admission: Admission) -> int:
        """Leading prompt tokens a request would load as an exact stored prefix if it started now: its
        full blocks found in the page pool or the store from the first on (all but the last token at
        most)."""
        pool = self.runtime.page_pool
        found = 0
        for key in admission.prefix_keys:
            if (pool is None or pool.table.lookup(key) is None) and not self.store.contains(key):
                break
            found += 1
        return min(found * admission.prefix_block_size, admission.prompt_tokens - 1)

    def live_kv_bytes(self) -> int:
        """KV memory the runtime holds now (:meth:`Runtime.kv_held_bytes`): the decode arena, every slot
        at its full capacity, free or not, plus the own buffers of live caches outside it (prefills that
        found no free slot, sparse sequences, stragglers, caches the arena had no room for), plus each
        prefix live caches share, once."""
        return self.runtime.kv_held_bytes()

    def kv_bytes_to_admit(self, admissions: list[Admission]) -> int:
        """What starting these requests adds to :meth:`live_kv_bytes`: a request whose cache starts in a
        free arena slot (:meth:`begin_prefill` claims one) adds nothing, the others their own cache."""
        return self.runtime.kv_bytes_to_claim([admission.kv_rows for admission in admissions])

    def reclaim_kv(self) -> None:
        """Drop a decode arena no sequence is bound to and shrink a mostly empty one (within the
        scheduler's ``max_live_kv_bytes`` while it reallocates)."""
        with self._lock:
            self.runtime.trim_arena(self.scheduler.config.max_live_kv_bytes)

    def text_stream(self, request: AnyRequest) -> TextStream:
        """A detokenizer for ``request``'s output, ending at its stop strings."""
        return TextStream(self.tokenizer, request.stop)

    # -- one request ----------------------------------------------------------------------------------
    def generate(
        self, prompt: str | None = None, on_token: TokenCallback | None = None, **options: Any
    ) -> Generation:
        """Generate a completion. Options are the fields of :class:`GenerateRequest`.

        on_token: called with each kept token id as soon as it is sampled (streaming); returning
        False stops the generation there.
        """
        request = self.resolve(GenerateRequest(prompt=prompt, **options))
        stream = self.text_stream(request) if request.stop else None
        callback = on_token if stream is None else _until_stop(stream, on_token)
        with self._lock:
            seq = self.prefill(request)
            seq.emit_pending(callback)  # before storing: a streaming client's TTFT excludes the store
            self.store_prefill(seq)
            self.decode(seq, on_token=callback)
            generation = self.finish(seq)
        if stream is not None and stream.stopped:
            generation = replace(generation, text=stream.text)
        return generation

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens of each text (no special tokens), on a private tokenizer copy (no engine lock: callable
        from any thread beside a step)."""
        with self.tokenizers.borrow() as tokenizer:
            return [len(tokenize_text(tokenizer, t)) for t in texts]

    def add_chunks(
        self, texts: list[str], config: BlendConfig | None = None, namespace: Namespace | None = None
    ) -> list[str]:
        """Precompute and store each text's position-independent KV for CacheBlend; returns chunk keys.

        config: its ``sink`` decides how chunks are computed (default: the engine's blend default).
        namespace: whose chunks they are (None: the default namespace; ``Namespace.shared()``: every
        tenant's requests find them).
        """
        with self._lock:
            return list(add_chunks(self.ctx, texts, config or self.defaults.blend, namespace))

    def failure_counts(self) -> dict[str, int]:
        """Background work that failed without failing a request: post-prefill hooks per path, and
        share index writes (journal / snapshot)."""
        counts = {f"after_prefill_{name}": n for name, n in self.hook_errors.items()}
        share = self.paths.get("share")
        counts["share_index_writes"] = int(getattr(share, "write_errors", 0))
        return counts

    def close(self) -> None:
        self.store.close()


class SelectionGuard:
    """A sequence's sparse decoder as the runtime's key gatherer, with its failure kept to itself: the
    first exception its ``gather`` raises is kept in :attr:`error`, and from then on (that layer
    included) the sequence attends to every row (``None``), so one sequence's failed selection does not
    fail the batched step of the others."""

    def __init__(self, decoder: SparseDecoder) -> None:
        self.decoder = decoder
        self.error: BaseException | None = None

    def gather(self, layer: int, q_rot: Tensor, cache: Any) -> Any:
        """The decoder's rows for ``layer`` (see :meth:`SparseDecoder.gather`), or None once it failed."""
        if self.error is not None:
            return None
        try:
            return self.decoder.gather(layer, q_rot, cache)
        except Exception as exc:
            self.error = exc
            return None


def _until_stop(stream: TextStream, on_token: TokenCallback | None) -> TokenCallback:
    """A token callback that feeds ``stream`` and stops the generation at a stop string (or when
    ``on_token`` asks)."""

    def callback(token: int) -> bool:
        keep_going = on_token(token) if on_token is not None else None
        stream.push(token)
        return keep_going is not False and not stream.stopped

    return callback
