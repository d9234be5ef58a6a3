"""Family adapters: the per-layer pieces of a Hugging Face decoder.

The runtime never calls a HF ``forward`` of a whole layer; it calls these small
pieces so it can choose which tokens go through each layer. The pieces run on the
HF checkpoint's own weights, packed once per layer into :class:`LayerWeights`: the
q/k/v projections stacked into one matrix and gate/up into another, so a layer is
two matmuls + attention + two matmuls, and a one-token decode step pays for few
operator calls. Stacking rows of a matrix does not change any output element, so
numerics follow the checkpoint (fp32 logits equal HF's to ~1e-6).

Precision: matmuls run in the dtype of the adapter's model (the compute dtype);
the residual stream, norms and RoPE run in float32 (RMSNorm statistics are taken in
fp32 by HF too). In fp32 this is HF's computation; in bf16 it is more accurate than
HF's bf16 forward, whose residual stream is bf16.

Every piece is row-wise (rows = tokens, of one sequence or of several): norms,
projections, MLP and logits could run over several sequences' rows at once; only
attention is per sequence.

Shapes use T = tokens, H = hidden size, nh = query heads, kvh = KV heads,
d = head dim, I = MLP width, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from semkv.models.linear import Projection


def rotate_half(x: Tensor) -> Tensor:
    """The HF rotate-half convention shared by every supported family."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [heads, T, d] by ``cos``/``sin`` [T, d] (computed in x's dtype)."""
    return x * cos.unsqueeze(0) + rotate_half(x) * sin.unsqueeze(0)


def rotate_queries(q: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> Tensor:
    """Queries ``q`` [nh, n, d] rotated by ``cos``/``sin`` [n, d] as attention uses them: RoPE in float32,
    rounded to ``dtype`` (the compute dtype)."""
    return apply_rope(q.float(), cos, sin).to(dtype)


def rope_sin_signed(sin: Tensor) -> Tensor:
    """``sin`` [T, d] with its first half negated: the table :func:`apply_rope_rolled` takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_rolled(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """:func:`apply_rope` bit for bit in 4 operator calls instead of 9, for a decode step's few rows, where
    each call costs more than its arithmetic: ``rotate_half(x) * sin`` is ``x.roll(d / 2) * sin_signed``
    (:func:`rope_sin_signed`; negating a factor negates a product exactly), and the [T, d] tables
    broadcast over the heads of ``x`` [heads, T, d] as they are."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def apply_rope_into(x: Tensor, cos: Tensor, sin_signed: Tensor, out: Tensor, scratch: Tensor) -> Tensor:
    """``apply_rope(x, cos, sin)`` of float32 ``x`` [heads, T, d] written into ``out`` (float32, x's shape), with
    ``scratch`` (the same) for ``rotate_half(x) * sin``; ``sin_signed`` is ``sin`` with its first half
    negated (:func:`rope_sin_signed`). The same bits as :func:`apply_rope`: negating a factor negates the
    product exactly, so no pass negates. For callers rotating many rows per layer into buffers they reuse
    (a key of another dtype is converted into a float32 buffer first: one conversion instead of one inside
    every product). Returns ``out``."""
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    torch.mul(x[..., half:], sin_signed[..., :half], out=scratch[..., :half])
    torch.mul(x[..., :half], sin_signed[..., half:], out=scratch[..., half:])
    return out.add_(scratch)


def _stack(modules: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """The weights [sum out, in] and biases (or None) of linear layers sharing their input, stacked."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return weight, None
    filled = [
        b.detach() if b is not None else m.weight.new_zeros(m.out_features)
        for m, b in zip(modules, biases, strict=True)
    ]
    return weight, torch.cat(filled)


def _bias(module: nn.Linear) -> Tensor | None:
    return module.bias.detach() if module.bias is not None else None


@dataclass
class LayerWeights:
    """One decoder layer's weights as the adapter runs them (matrices in the compute dtype, each a
    :class:`~semkv.models.linear.Projection`, packed once for oneDNN where that pays).

    qkv: [(nh + 2 kvh) d, H] the q, k, v projections stacked; o: [H, nh d];
    gate_up: [2 I, H] the gate and up projections stacked; down: [H, I].
    norms: name -> (float32 weight of the RMSNorm as applied (Gemma's ``1 + w`` already added), eps).
    """

    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    norms: dict[str, tuple[Tensor, float]]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in float32: ``weight * x / sqrt(mean(x^2) + eps)`` (HF's numerics)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


class LlamaFamilyAdapter:
    """Llama-style decoders: Llama (SmolLM2), Qwen2, Mistral.

    Layer = input_layernorm -> q/k/v projections -> RoPE -> attention -> o_proj
    -> residual -> post_attention_layernorm -> MLP -> residual.
    """

    model_types: ClassVar[tuple[str, ...]] = ("llama", "qwen2", "mistral")

    def __init__(self, hf_model: nn.Module, private: bool = False, pack_weights: bool = True) -> None:
        """private: ``hf_model`` belongs to this adapter alone (a runtime's cast copy), so its q/k/v and
        gate/up modules are re-pointed at views of the stacked matrices instead of keeping a second
        copy. A caller's model is never changed (its stacked matrices are copies).
        pack_weights: let each :class:`~semkv.models.linear.Projection` keep a oneDNN-packed copy where that
        runs (False: never; see :class:`~semkv.config.EngineConfig`)."""
        self.hf_model = hf_model
        self.private = private
        self.pack_weights = pack_weights
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
        self.dtype: torch.dtype = hf_model.get_input_embeddings().weight.dtype  # the compute dtype
        self.act = [block.mlp.act_fn for block in self.layers]
        self.final_norm = self._norm(self.decoder.norm)
        self._weights: list[LayerWeights] | None = None
        self._head: Projection | None = None

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

    def _pack(self, layer: int) -> LayerWeights:
        """Layer ``layer``'s HF weights as :class:`LayerWeights` (stacked copies)."""
        block = self.layers[layer]
        attn, mlp = block.self_attn, block.mlp
        qkv, qkv_bias = _stack([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _stack([mlp.gate_proj, mlp.up_proj])
        return LayerWeights(
            qkv=self._projection(qkv, qkv_bias),
            o=self._projection(attn.o_proj.weight, _bias(attn.o_proj)),
            gate_up=self._projection(gate_up, gate_up_bias),
            down=self._projection(mlp.down_proj.weight, _bias(mlp.down_proj)),
            norms=self._norm_weights(block),
        )

    def _projection(self, weight: Tensor, bias: Tensor | None) -> Projection:
        return Projection.make(weight, bias, prepack=None if self.pack_weights else False)

    def _norm_weights(self, block: nn.Module) -> dict[str, tuple[Tensor, float]]:
        """Each RMSNorm of ``block`` as (float32 weight as applied, eps)."""
        return {
            "input": self._norm(block.input_layernorm),
            "post_attention": self._norm(block.post_attention_layernorm),
        }

    def _norm(self, norm: nn.Module) -> tuple[Tensor, float]:
        """(float32 weight, eps) of a Llama-style RMSNorm (output = weight * normalised x)."""
        return norm.weight.detach().float(), float(norm.variance_epsilon)

    @property
    def weights(self) -> list[LayerWeights]:
        """Every layer's :class:`LayerWeights`, packed on first use."""
        if self._weights is None:
            self._weights = self._pack_all()
        return self._weights

    def _pack_all(self) -> list[LayerWeights]:
        packed = [self._pack(layer) for layer in range(self.num_layers)]
        if self.private:
            for layer, w in enumerate(packed):
                block = self.layers[layer]
                self._share(
                    [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj],
                    w.qkv.weight,
                    w.qkv.bias,
                )
                self._share([block.mlp.gate_proj, block.mlp.up_proj], w.gate_up.weight, w.gate_up.bias)
        return packed

    @staticmethod
    def _share(modules: list[nn.Linear], weight: Tensor, bias: Tensor | None) -> None:
        start = 0
        for module in modules:
            rows = slice(start, start + module.out_features)
            module.weight = nn.Parameter(weight[rows], requires_grad=False)
            if module.bias is not None and bias is not None:
                module.bias = nn.Parameter(bias[rows], requires_grad=False)
            start += module.out_features

    def _split_heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[T, (nh + 2 kvh) d] -> q [T, nh, d], k [T, kvh, d], v [T, kvh, d] (views)."""
        nh, kvh = self.num_heads, self.num_kv_heads
        heads = qkv.view(qkv.shape[0], nh + 2 * kvh, self.head_dim)
        return heads[:, :nh], heads[:, nh : nh + kvh], heads[:, nh + kvh :]

    def qkv(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [T, H] (float32 residual) -> q [nh, T, d], k [kvh, T, d], v [kvh, T, d] in the compute
        dtype; q and k before RoPE."""
        w = self.weights[layer]
        x = rms_norm(hidden, *w.norms["input"]).to(self.dtype)
        q, k, v = self._split_heads(w.qkv(x))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def mlp(self, layer: int, x: Tensor) -> Tensor:
        """x [T, H] (normed, compute dtype) -> the MLP's output [T, H] (compute dtype)."""
        w = self.weights[layer]
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        return w.down(self.act[layer](gate) * up)

    def finish_layer(self, layer: int, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """hidden [T, H] (the layer's input, float32), attn_out [T, nh*d] -> the layer's output [T, H]
        (float32)."""
        w = self.weights[layer]
        hidden = hidden + w.o(attn_out).float()
        x = rms_norm(hidden, *w.norms["post_attention"]).to(self.dtype)
        return hidden + self.mlp(layer, x).float()

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [T, H] (last layer output) -> logits [T, V] in float32."""
        x = rms_norm(hidden, *self.final_norm)
        return self.head(x.to(self.dtype)).float()

    @property
    def head(self) -> Projection:
        """The lm_head [V, H] as a :class:`~semkv.models.linear.Projection` (made on first use; where it
        is packed, a tied head's packed copy is separate from the embedding table it shares)."""
        if self._head is None:
            lm_head = self.hf_model.lm_head
            self._head = self._projection(lm_head.weight, _bias(lm_head))
        return self._head
