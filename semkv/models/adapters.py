"""Family adapters: the per-layer pieces of a Hugging Face decoder, re-used as they are.

The runtime never calls a HF ``forward`` of a whole layer; it calls these small
pieces so it can choose which tokens go through each layer. An adapter owns no
weights of its own: every projection, norm, MLP and rotary table is the HF
module's, so numerics follow the checkpoint exactly.

Shapes use T = tokens, H = hidden size, nh = query heads, kvh = KV heads,
d = head dim, V = vocab.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """The HF rotate-half convention shared by every supported family."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [heads, T, d] by ``cos``/``sin`` [T, d] (computed in x's dtype)."""
    return x * cos.unsqueeze(0) + rotate_half(x) * sin.unsqueeze(0)


class LlamaFamilyAdapter:
    """Llama-style decoders: Llama (SmolLM2), Qwen2, Mistral.

    Layer = input_layernorm -> q/k/v projections -> RoPE -> attention -> o_proj
    -> residual -> post_attention_layernorm -> MLP -> residual.
    """

    model_types: ClassVar[tuple[str, ...]] = ("llama", "qwen2", "mistral")

    def __init__(self, hf_model: nn.Module) -> None:
        self.hf_model = hf_model
        self.config = hf_model.config
        self.decoder = hf_model.model
        self.layers = self.decoder.layers
        cfg = self.config
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.max_positions: int = cfg.max_position_embeddings
        self._windows = [self._layer_window(i) for i in range(self.num_layers)]

    # -- structure -------------------------------------------------------------------------
    def _layer_window(self, layer: int) -> int | None:
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        if self.config.model_type == "mistral":
            return window
        return None

    def window(self, layer: int) -> int | None:
        """Sliding-window size of ``layer`` (a query sees keys with q_pos - k_pos < window), or None."""
        return self._windows[layer]

    def rope_group(self, layer: int) -> str:
        """Layers of one group share one rotary table (every layer, for this family)."""
        return "default"

    def scaling(self, layer: int) -> float:
        return float(self.layers[layer].self_attn.scaling)

    # -- pieces ----------------------------------------------------------------------------
    def embed(self, token_ids: Tensor) -> Tensor:
        """token_ids [T] -> hidden [T, H]."""
        return self.decoder.embed_tokens(token_ids)

    def rotary(self, positions: Tensor, layer: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] -> (cos, sin), each [T, d] in ``like``'s dtype, from the model's own rotary module."""
        cos, sin = self.decoder.rotary_emb(like, positions.unsqueeze(0))
        return cos[0], sin[0]

    def qkv(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [T, H] -> q [nh, T, d], k [kvh, T, d], v [kvh, T, d]; q and k before RoPE."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        tokens = x.shape[0]
        q = attn.q_proj(x).view(tokens, -1, self.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(tokens, -1, self.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(tokens, -1, self.head_dim).transpose(0, 1)
        return q, k, v

    def finish_layer(self, layer: int, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """hidden [T, H] (the layer's input), attn_out [T, nh*d] -> the layer's output [T, H]."""
        block = self.layers[layer]
        hidden = hidden + block.self_attn.o_proj(attn_out)
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [T, H] (last layer output) -> logits [T, V] in float32."""
        return self.hf_model.lm_head(self.decoder.norm(hidden)).float()
