"""The request pipeline, as public steps: prefill -> decode -> store -> finish.

A request goes through:

1. :meth:`Engine.layout` — the prompt as tokenized segments (template, chunks, body, suffix);
2. :meth:`Engine.plan` — every reuse path is asked for an offer (``semkv/reuse/``); the one that
   reuses most is chosen, the others' refusals are kept;
3. :meth:`Engine.prefill` — a live cache is filled by the chosen path, the first token sampled:
   a :class:`~semkv.sequence.Sequence`;
4. :meth:`Engine.decode_step` / :meth:`Engine.decode` — one or many decode steps (dense, or through
   the request's sparse decoder);
5. :meth:`Engine.store_prefill` — what the prefill made reusable (prefix blocks, chunks, the prompt for
   sharing) goes to the store; done after the first token, so it is not in TTFT;
6. :meth:`Engine.finish` — the :class:`~semkv.request.Generation` (text, token ids, stats).

:meth:`Engine.generate` composes them for one request.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from semkv.config import EngineConfig, StoreConfig, make_private_dir
from semkv.models.loader import load_model, model_fingerprint
from semkv.models.registry import adapter_for
from semkv.models.runtime import Runtime
from semkv.profile import EngineDefaults, check_request, defaults_from_profile, load_profile
from semkv.prompt import PromptLayout, build_layout
from semkv.request import GenerateRequest, Generation
from semkv.reuse.base import Plan, PrefillContext, PrefillOutcome, Refusal, ReusePath
from semkv.reuse.blend import add_chunks
from semkv.reuse.options import BlendConfig
from semkv.reuse.registry import FULL, build_paths
from semkv.sequence import Sequence, TokenCallback
from semkv.sparse.base import SparsePolicy
from semkv.sparse.decoder import SparseDecoder
from semkv.sparse.index import BlockIndex, capture_prefill_queries
from semkv.sparse.session import decoder_for
from semkv.store.entry import KVShape
from semkv.store.keys import Namespace
from semkv.store.store import KVStore

log = logging.getLogger(__name__)

SHARE_INDEX_DIR = "share_index"


class Engine:
    """A model, its runtime, its KV store and its reuse paths.

    Thread-safe: the public steps hold one re-entrant lock, so requests run one at a time.
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
        compute_dtype = config.torch_compute_dtype
        # the runtime runs a private copy in the compute dtype if hf_model is in another one
        self.runtime = Runtime(
            adapter_for(hf_model.config.model_type)(hf_model), config.torch_kv_dtype, compute_dtype
        )
        self.adapter = self.runtime.adapter
        self.fingerprint = model_fingerprint(hf_model, tokenizer, config.torch_kv_dtype, compute_dtype)
        make_private_dir(config.home_path)
        shape = KVShape(self.adapter.num_layers, self.adapter.num_kv_heads, self.adapter.head_dim)
        self.store = KVStore.from_config(config.store, config.home_path, self.fingerprint, shape)
        self.ctx = PrefillContext(self.runtime, self.store, self.fingerprint, config.block_size, tokenizer)
        self.paths: dict[str, ReusePath] = build_paths(self.share_index_folder())
        # defaults measured by `semkv calibrate` for this fingerprint, if any
        self.defaults: EngineDefaults = defaults_from_profile(
            load_profile(config.home_path, self.fingerprint)
        )
        self.max_context = int(self.adapter.max_positions)
        self.eos_ids = frozenset(self._eos_ids())
        self.hook_errors: dict[str, int] = {}  # path name -> post-prefill hooks that raised
        self._lock = threading.RLock()

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
        )
        make_private_dir(config.home_path)
        loaded = load_model(config.model, config.home_path, config.models_path, config.torch_device)
        return cls(config, loaded.hf_model, loaded.tokenizer, name=loaded.name)

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> Engine:
        """An engine from the standard CLI flags (``--model --home --kv-dtype --block-size --threads``,
        and ``--models-dir`` / ``--device`` / ``--compute-dtype`` where a command has them); ``overrides`` replace or add
        keyword arguments."""
        options: dict[str, Any] = {
            "home": args.home,
            "kv_dtype": args.kv_dtype,
            "block_size": args.block_size,
            "threads": args.threads,
            "models_dir": getattr(args, "models_dir", None),
            "device": getattr(args, "device", None) or "cpu",
            "compute_dtype": getattr(args, "compute_dtype", None) or "auto",
        }
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

    def share_index_folder(self) -> Path | None:
        """``<home>/share_index/<fingerprint[:16]>`` when the store keeps a disk tier, else None (the
        share path's index then lives in memory only)."""
        if not self.config.store.disk:
            return None
        return self.config.home_path / SHARE_INDEX_DIR / self.fingerprint[:16]

    # -- layout & planning -------------------------------------------------------------------------
    def layout(self, request: GenerateRequest) -> PromptLayout:
        """The request's prompt as tokenized segments; a ValueError if it is empty or too long."""
        layout = build_layout(
            self.tokenizer,
            request.prompt,
            request.messages,
            request.chunks,
            request.use_chat_template,
            request.assistant_prefix,
        )
        total = len(layout) + request.max_new_tokens
        if len(layout) == 0:
            raise ValueError("prompt is empty after tokenization")
        if total > self.max_context:
            raise ValueError(
                f"prompt of {len(layout)} tokens + max_new_tokens {request.max_new_tokens} exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        return layout

    def plan(
        self, request: GenerateRequest, layout: PromptLayout | None = None
    ) -> tuple[Plan, list[Refusal]]:
        """Pick the prefill path: under "auto" the one that reuses most; an explicit mode, or an exact
        prefix hit when it reuses more (exact reuse is always allowed); "none" is full prefill.
        Returns the plan and the refusals of the paths asked."""
        layout = layout if layout is not None else self.layout(request)
        options = self.defaults.reuse_options(request)
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
    def prefill(self, request: GenerateRequest, *, capture_queries: bool = False) -> Sequence:
        """Lay out and plan ``request``, fill a live cache through the chosen path and sample the first
        token. ``capture_queries`` keeps the prompt's queries (needed to :meth:`fork` into SnapKV/H2O).
        The TTFT (``seq.ttft_s``) covers planning, prefill and the first token; nothing is stored yet."""
        with self._lock:
            layout = self.layout(request)
            check_request(self.defaults, request)  # warns below the calibrated profile
            start = time.perf_counter()
            options = self.defaults.reuse_options(request)
            plan, refusals = self.plan(request, layout)
            cache = self.runtime.new_cache(len(layout) + request.max_new_tokens)
            policy, kv_budget, sparse_notes = self.defaults.resolve_sparse(request, len(layout))
            sparse = self.sparse_decoder(policy, kv_budget)
            capture = capture_queries or (sparse is not None and sparse.policy.needs_prefill_queries)
            queries = None
            if capture:
                with capture_prefill_queries(cache) as queries:
                    outcome = self.paths[plan.path].prefill(self.ctx, plan, cache)
                if sparse is not None:
                    sparse.prefill = queries
            else:
                outcome = self.paths[plan.path].prefill(self.ctx, plan, cache)
            blocks, summarise_s = self._summarise(cache, outcome)
            if sparse is not None:
                sparse.attach(blocks)
            seq = Sequence(
                request=request,
                options=options,
                layout=layout,
                plan=plan,
                refusals=refusals,
                outcome=outcome,
                cache=cache,
                sparse=sparse,
                generator=torch.Generator().manual_seed(request.seed),
                eos_ids=self.eos_ids,
                kv_budget=kv_budget,
                prefill_queries=queries,
                blocks=blocks,
                summarise_s=summarise_s,
                notes={**self._fallback_note(options.mode, outcome.path, refusals), **sparse_notes},
            )
            seq.sample(outcome.logits)
            seq.ttft_s = time.perf_counter() - start
            return seq

    def _summarise(self, cache, outcome: PrefillOutcome) -> tuple[BlockIndex, float]:
        """The block summaries of a freshly prefilled cache (write time: sparse decode then starts with
        every prompt block summarised): those the reused blocks carried, the rest computed from the rows.
        Returns the index and the seconds spent (part of the TTFT)."""
        start = time.perf_counter()
        blocks = BlockIndex(cache, self.config.block_size)
        for summary in outcome.stored_summaries:
            try:
                blocks.insert(summary)
            except ValueError as exc:  # stored by another version: summarise the rows instead
                log.warning("recomputing block summaries: %s", exc)
                break
        blocks.add_blocks()
        outcome.summaries = blocks
        return blocks, time.perf_counter() - start

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
            logits = self.runtime.decode(seq.cache, seq.tokens[-1], seq.sparse)
            seq.sample(logits)
            return logits

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
            generator = torch.Generator()
            generator.set_state(seq.generator.get_state())
            cache = copy.deepcopy(seq.cache)
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

    # -- one request ----------------------------------------------------------------------------------
    def generate(
        self, prompt: str | None = None, on_token: TokenCallback | None = None, **options: Any
    ) -> Generation:
        """Generate a completion. Options are the fields of :class:`GenerateRequest`.

        on_token: called with each kept token id as soon as it is sampled (streaming); returning
        False stops the generation there.
        """
        request = GenerateRequest(prompt=prompt, **options)
        with self._lock:
            seq = self.prefill(request)
            seq.emit_pending(on_token)  # before storing: a streaming client's TTFT excludes the store
            self.store_prefill(seq)
            self.decode(seq, on_token=on_token)
            return self.finish(seq)

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
