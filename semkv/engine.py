"""The request pipeline: layout -> plan -> prefill -> store -> decode."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from semkv.calibrate import apply_profile, check_request, load_profile
from semkv.config import EngineConfig, StoreConfig
from semkv.models.adapters import adapter_for
from semkv.models.cache import KVCache
from semkv.models.loader import load_model, model_fingerprint
from semkv.models.runtime import Runtime
from semkv.prompt import PromptLayout, build_layout
from semkv.request import DEFAULT_KV_BUDGET, GenerateRequest, Generation
from semkv.reuse import POST_PREFILL_HOOKS, REUSE_PATHS, Plan, PrefillContext, PrefillOutcome, Refusal
from semkv.reuse.prefix import store_prefix
from semkv.sparse import SparseDecoder
from semkv.sparse.session import decoder_for, prefill_capture
from semkv.store.store import KVStore

log = logging.getLogger(__name__)


def sample_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else temperature + nucleus sampling. logits: [V]."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


class Engine:
    """A model, its runtime and its KV store. Thread-safe: requests run one at a time."""

    def __init__(
        self, config: EngineConfig, hf_model: torch.nn.Module, tokenizer: Any, name: str = ""
    ) -> None:
        self.config = config
        self.name = name or config.model
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.adapter = adapter_for(hf_model.config.model_type)(hf_model)
        self.runtime = Runtime(self.adapter, config.torch_kv_dtype)
        self.fingerprint = model_fingerprint(hf_model, tokenizer, config.torch_kv_dtype)
        self.store = KVStore.from_config(config.store, config.home_path, self.fingerprint)
        self.ctx = PrefillContext(self.runtime, self.store, self.fingerprint, config.block_size, tokenizer)
        # defaults measured by `semkv calibrate` for this fingerprint, if any
        apply_profile(self.ctx.settings, load_profile(config.home_path, self.fingerprint))
        self.max_context = int(self.adapter.max_positions)
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()

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
    ) -> Engine:
        """Load an embedded model by name (converted once into ``home``, or ``models_dir``) or a local HF
        checkpoint folder."""
        config = EngineConfig(
            model=model,
            home=home,
            kv_dtype=kv_dtype,
            block_size=block_size,
            threads=threads,
            store=store or StoreConfig(),
            models_dir=models_dir,
        )
        loaded = load_model(config.model, config.home_path, config.models_path)
        return cls(config, loaded.hf_model, loaded.tokenizer, name=loaded.name)

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> Engine:
        """An engine from the standard CLI flags (``--model --home --kv-dtype --block-size --threads``,
        and ``--models-dir`` where a command has it); ``overrides`` replace or add keyword arguments."""
        options: dict[str, Any] = {
            "home": args.home,
            "kv_dtype": args.kv_dtype,
            "block_size": args.block_size,
            "threads": args.threads,
            "models_dir": getattr(args, "models_dir", None),
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

    # -- layout & planning -------------------------------------------------------------------------
    def layout(self, request: GenerateRequest) -> PromptLayout:
        layout = build_layout(
            self.tokenizer, request.prompt, request.messages, request.chunks, request.use_chat_template
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

    def plan(self, request: GenerateRequest, layout: PromptLayout) -> tuple[Plan, list[Refusal]]:
        """Pick the prefill path: the requested one, or under "auto" the one that reuses most."""
        if request.reuse == "none":
            return REUSE_PATHS["full"].plan(self.ctx, request, layout), []
        names = [n for n in REUSE_PATHS if n != "full"] if request.reuse == "auto" else [request.reuse]
        best: Plan | None = None
        refusals: list[Refusal] = []
        for name in names:
            offer = REUSE_PATHS[name].plan(self.ctx, request, layout)
            if isinstance(offer, Refusal):
                refusals.append(offer)
            elif best is None or offer.reused_tokens > best.reused_tokens:
                best = offer
        if best is None:
            best = REUSE_PATHS["full"].plan(self.ctx, request, layout)
        return best, refusals

    def kv_budget_for(self, request: GenerateRequest) -> float | int:
        """The request's kv_budget, else the calibrated budget of its sparse policy, else the default."""
        if request.kv_budget is not None:
            return request.kv_budget
        policy = getattr(request.sparse, "name", request.sparse)
        return self.ctx.settings.get("kv_budget", {}).get(policy, DEFAULT_KV_BUDGET)

    # -- the pipeline --------------------------------------------------------------------------------
    def generate(
        self, prompt: str | None = None, on_token: Callable[[int], bool | None] | None = None, **options: Any
    ) -> Generation:
        """Generate a completion. Options are the fields of :class:`GenerateRequest`.

        on_token: called with each kept token id as soon as it is sampled (streaming); returning
        False stops the generation there.
        """
        request = GenerateRequest(prompt=prompt, **options)
        with self._lock:
            return self._generate(request, on_token)

    def _generate(
        self, request: GenerateRequest, on_token: Callable[[int], bool | None] | None = None
    ) -> Generation:
        layout = self.layout(request)
        check_request(self.ctx.settings, request)  # warns below the calibrated profile
        prompt_ids = layout.token_ids
        start = time.perf_counter()
        plan, refusals = self.plan(request, layout)
        cache = self.runtime.new_cache(len(prompt_ids) + request.max_new_tokens)
        sparse = decoder_for(request.sparse, self.kv_budget_for(request), self.config.block_size)
        with prefill_capture(sparse, self.runtime, cache):
            outcome = REUSE_PATHS[plan.path].prefill(self.ctx, plan, cache)
        generator = torch.Generator().manual_seed(request.seed)
        token = sample_token(outcome.logits, request.temperature, request.top_p, generator)
        ttft = time.perf_counter() - start
        stopped = self._emit(on_token, token, request)  # before storing: streaming TTFT excludes the store
        store_s = self._after_prefill(request, layout, cache, outcome)
        generated, decode_s = self._decode(cache, token, request, generator, on_token, stopped, sparse)
        stats = {
            "ttft_s": ttft,
            "decode_s": decode_s,
            "decode_ms_per_token": 1000 * decode_s / max(1, len(generated) - 1),
            "store_s": store_s,
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": len(generated),
            "reused_tokens": outcome.reused_tokens,
            "recomputed_tokens": outcome.recomputed_tokens,
            "path": outcome.path,
            "refused": {r.path: r.reason for r in refusals},
            **outcome.info,
            **(sparse.stats(decode_s) if sparse is not None else {}),
        }
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        return Generation(text=text, token_ids=generated, stats=stats, first_logits=outcome.logits)

    def _after_prefill(
        self, request: GenerateRequest, layout: PromptLayout, cache: KVCache, outcome: PrefillOutcome
    ) -> float:
        """Store what the prefill made reusable; run the post-prefill hooks. Returns seconds spent."""
        start = time.perf_counter()
        if request.store_prompt:
            if outcome.exact:
                store_prefix(self.ctx, cache, layout.token_ids)
            for hook in POST_PREFILL_HOOKS:
                hook(self.ctx, request, layout, cache, outcome)
        return time.perf_counter() - start

    def _emit(
        self, on_token: Callable[[int], bool | None] | None, token: int, request: GenerateRequest
    ) -> bool:
        """Hand a kept (non-final-EOS) token to ``on_token``; True if it asked to stop."""
        if on_token is None or (request.stop_at_eos and token in self.eos_ids):
            return False
        return on_token(token) is False

    def _decode(
        self,
        cache: KVCache,
        first: int,
        request: GenerateRequest,
        generator: torch.Generator,
        on_token: Callable[[int], bool | None] | None = None,
        stopped: bool = False,
        sparse: SparseDecoder | None = None,
    ) -> tuple[list[int], float]:
        generated = [first]
        start = time.perf_counter()
        token = first
        while (
            not stopped
            and len(generated) < request.max_new_tokens
            and not (request.stop_at_eos and token in self.eos_ids)
        ):
            logits = self.runtime.decode(cache, token, sparse)
            token = sample_token(logits, request.temperature, request.top_p, generator)
            generated.append(token)
            stopped = self._emit(on_token, token, request)
        if sparse is not None:
            sparse.finish()
        if request.stop_at_eos and generated and generated[-1] in self.eos_ids:
            generated.pop()
        return generated, time.perf_counter() - start

    def add_chunks(self, texts: list[str], config: Any = None) -> list[str]:
        """Precompute and store each text's position-independent KV for CacheBlend; returns chunk keys.

        config: a ``semkv.reuse.blend.BlendConfig`` (its ``sink`` decides how chunks are computed).
        """
        from semkv.reuse.blend import add_chunks

        with self._lock:
            return list(add_chunks(self.ctx, texts, config))

    def close(self) -> None:
        self.store.close()
