"""Linear projections whose weights are packed once for the CPU's matmul library.

torch's CPU ``F.linear`` in bfloat16 hands the weight to oneDNN in its plain row-major layout, and oneDNN
reorders it into its blocked layout on *every* call. For the few rows of a decode step that reorder is
most of the call; for a blend's hundreds of rows still a good part of it. oneDNN's own entry points take
a weight reordered once (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what torch's
inductor uses for CPU linears) and give the very same bits as ``F.linear`` (the same kernel, minus the
reorder); the per-shape timings are in docs/history/measurements.md ("Packed weights").

The packed copy is an opaque oneDNN tensor held next to the plain weight (which the model's modules and
the tests still read), so packing doubles the memory of the matrices it packs. Elsewhere (float32, GPUs,
builds without oneDNN bf16) a :class:`Projection` is ``F.linear``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)


def _mkldnn_supports(dtype: torch.dtype) -> bool:
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(
        dtype
    )
    return probe is not None and hasattr(ops, probe) and bool(getattr(ops, probe)())


def prepacks(device: torch.device, dtype: torch.dtype) -> bool:
    """True where a :class:`Projection` packs its weight: CPU in bf16 / fp16 with oneDNN support for it."""
    return device.type == "cpu" and _mkldnn_supports(dtype)


def _pack(weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """oneDNN's blocked copy of ``weight`` [out, in], or None (logged) if this build cannot pack it or its
    products differ from ``F.linear``'s on a probe input."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype, device=weight.device).view(
            3, -1
        )
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        want = F.linear(probe, weight, bias)
    except RuntimeError as error:
        log.warning(
            "linear weights stay unpacked: oneDNN could not pack a %s matrix (%s)", weight.dtype, error
        )
        return None
    if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
        log.warning("linear weights stay unpacked: oneDNN's packed product differs from F.linear's")
        return None
    return packed


@dataclass(frozen=True)
class Projection:
    """``x @ weight^T + bias`` for x [..., in] -> [..., out] in the weight's dtype.

    weight: [out, in]; bias: [out] or None; packed: oneDNN's blocked copy of ``weight`` (see the module
    docstring) or None, in which case the product is ``F.linear``.
    """

    weight: Tensor
    bias: Tensor | None = None
    packed: Tensor | None = None

    @classmethod
    def make(cls, weight: Tensor, bias: Tensor | None = None, prepack: bool | None = None) -> Projection:
        """A projection over ``weight`` [out, in] (and ``bias`` [out]); ``prepack``: pack the weight (None:
        where :func:`prepacks` says it pays)."""
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        if prepack is None:
            prepack = prepacks(weight.device, weight.dtype)
        return cls(weight, bias, _pack(weight, bias) if prepack else None)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
