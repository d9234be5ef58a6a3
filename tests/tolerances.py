"""Tolerances for comparing two computations of one value by kernels that round differently.

A batched decode step and a one-sequence step, our attention kernel and a plain softmax, our runtime and
HF's forward: each pair computes the same sums, in different orders (GEMV vs GEMM blocking, AVX2 vs
AVX-512 vs AMX tiles, one attention call vs one per sequence). Their results differ by rounding only, and
by how much depends on the dtype and the reductions, not on the CPU the suite happens to run on. The
bounds below are derived from that, so a test passes on AMD, Intel (AVX-512, AMX) and GPUs alike, and a
real error (a wrong row, mask or position: differences of the order of the values themselves) still fails.

Derivation
----------
1. One reduction. A dot product s = sum_i x_i y_i of K terms computed in floating point with unit
   roundoff u (half the dtype's machine epsilon: 2^-24 for float32) in *any* order satisfies
   |fl(s) - s| <= gamma_K * S with S = sum_i |x_i y_i| and gamma_K = K u / (1 - K u) (Higham, *Accuracy
   and Stability of Numerical Algorithms*, 2nd ed., §3.1). That worst case assumes every rounding error
   has the same sign; modelled as independent zero-mean variables they give |fl(s) - s| <= lam sqrt(K) u S
   except with probability decaying like exp(-lam^2 / 2) (Higham & Mary, "A new approach to probabilistic
   rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019). Two kernels are each that close to s, so
   they differ by at most twice it:  |a - b| <= 2 lam sqrt(K) u S  (:func:`reduction_atol`).
2. S from what a test sees. For terms of random sign (projections with random weights) |s| ~ sqrt(K)
   sigma while S ~ K E|x y| ~ sqrt(K) |s|: S <= sqrt(K) M with M the largest magnitude among the compared
   results, hence |a - b| <= 2 lam K u M. For a convex combination (attention weights times values)
   S <= max |v| exactly.
3. A model. Logits come out of a chain of D reductions (per layer: q/k/v, attention logits, weights x
   values, output projection, gate/up, down: 6; then the LM head). Each adds its own independent
   difference; the residual stream carries earlier ones forward with gain ~1 to first order (every
   sub-layer reads a normalised input), so they add in quadrature: |a - b| <= 2 lam K u sqrt(D) M, with
   K the longest reduction (hidden or intermediate size, or the attended rows) (:func:`model_atol`).
   In bf16 / fp16 the products accumulate in float32 but every op's output is rounded to the low
   precision: two paths differ by up to one such rounding per op where they round different
   intermediates, 2 lam u_low sqrt(D) M, u_low = 2^-8 (bf16) or 2^-11 (fp16); the float32 term is added.

``LAMBDA`` = 3 (three standard deviations of the rounding-error model).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LAMBDA = 3.0
STAGES_PER_LAYER = 6  # q/k/v, attention logits, weights x values, output projection, gate/up, down


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2 of ``dtype`` (the largest relative error of one rounding)."""
    return torch.finfo(dtype).eps / 2


def magnitude(x: Tensor) -> float:
    """The largest |value| of ``x`` (the scale the bounds are relative to)."""
    return float(x.detach().float().abs().max()) if x.numel() else 0.0


def reduction_atol(k: int, abs_sum: float, dtype: torch.dtype = torch.float32, stages: int = 1) -> float:
    """Largest expected |a - b| between two kernels' results of ``stages`` chained reductions of ``k``
    terms each whose absolute terms sum to at most ``abs_sum`` (step 1 above)."""
    return 2 * LAMBDA * math.sqrt(k) * unit_roundoff(dtype) * abs_sum * math.sqrt(stages)


def model_atol(
    reference: Tensor,
    *,
    reduction: int,
    layers: int,
    compute_dtype: torch.dtype = torch.float32,
) -> float:
    """Largest expected |a - b| between two kernels' results of a model output ``reference`` (logits)
    computed in ``compute_dtype`` through ``layers`` layers whose longest reduction has ``reduction``
    terms (steps 2 and 3 above)."""
    stages = STAGES_PER_LAYER * layers + 1
    scale = magnitude(reference)
    atol = 2 * LAMBDA * reduction * unit_roundoff(torch.float32) * math.sqrt(stages) * scale
    if compute_dtype != torch.float32:
        atol += 2 * LAMBDA * unit_roundoff(compute_dtype) * math.sqrt(stages) * scale
    return atol


def config_atol(
    reference: Tensor, config, compute_dtype: torch.dtype = torch.float32, context: int = 0
) -> float:
    """:func:`model_atol` for a model of HF ``config`` attending over at most ``context`` rows."""
    reduction = max(config.hidden_size, config.intermediate_size, context)
    return model_atol(
        reference, reduction=reduction, layers=config.num_hidden_layers, compute_dtype=compute_dtype
    )


def attention_atol(
    q: Tensor, k: Tensor, v: Tensor, scaling: float, dtype: torch.dtype | None = None
) -> float:
    """Largest expected |a - b| between two attention kernels over q [nh, Tq, d], k, v [kvh, Tk, d].

    The logits q.k (d terms, S bounded by the largest sum_i |q_i k_i|, computed here) shift the softmax
    weights by at most their error (a weight's relative change is the logits' absolute one), which moves
    the output by at most twice that times max |v|; the weighted sum of Tk values (a convex combination: S <= max |v|)
    adds its own."""
    dtype = dtype or q.dtype
    vmax = magnitude(v)
    rep = q.shape[0] // k.shape[0]
    abs_logits = scaling * torch.matmul(
        q.detach().float().abs(), k.detach().float().abs().repeat_interleave(rep, 0).transpose(1, 2)
    )
    logits = reduction_atol(q.shape[-1], magnitude(abs_logits), dtype)
    values = reduction_atol(k.shape[1], vmax, dtype)
    # o = sum_j w_j v_j with w = softmax(l): |do| <= sum_j w_j |dl_j - sum_i w_i dl_i| |v_j| <= 2 max|dl| max|v|
    return 2 * logits * vmax + values


def assert_close_across_kernels(
    got: Tensor, want: Tensor, config, compute_dtype: torch.dtype = torch.float32, context: int = 0
) -> None:
    """``got`` equals ``want`` (model outputs of HF ``config``) up to :func:`config_atol` of ``want``."""
    atol = config_atol(want.float(), config, compute_dtype, context)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
