"""The compute dtype: which floating-point type the runtime's matmuls and attention run in.

``"auto"`` picks bfloat16 where the device has fast bf16 arithmetic (CPU: AVX512-BF16 or AMX,
as torch reports it; CUDA: ``torch.cuda.is_bf16_supported()``), else float32. The KV dtype at rest
is its own setting (``EngineConfig.kv_dtype``).

A model runs in its compute dtype through a private copy of its weights in that dtype
(:func:`cast_model`); the caller's model is never changed.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
COMPUTE_DTYPE_CHOICES: tuple[str, ...] = ("auto", *COMPUTE_DTYPES)


def _cpu_flag(name: str) -> bool:
    """A ``torch.cpu._is_*_supported`` probe; False where this torch build lacks it."""
    probe = getattr(torch.cpu, name, None)
    return bool(probe()) if callable(probe) else False


def fast_dtype(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """True if ``device`` computes in ``dtype`` natively (not by emulation): fp32 everywhere; bf16 on CPUs
    with AVX512-BF16 or AMX and on CUDA devices that support it; fp16 on CPUs with AMX-FP16 and on CUDA."""
    device = torch.device(device)
    if dtype == torch.float32:
        return True
    if device.type == "cuda":
        return dtype == torch.float16 or bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    if dtype == torch.bfloat16:
        return _cpu_flag("_is_avx512_bf16_supported") or _cpu_flag("_is_amx_tile_supported")
    if dtype == torch.float16:
        return _cpu_flag("_is_amx_fp16_supported")
    return False


def resolve_compute_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype for a ``compute_dtype`` setting on ``device``.

    "auto": bfloat16 if the device has fast bf16, else float32. An explicit "bfloat16" / "float16" on a
    device without fast support still runs (emulated, slowly) and says so in a warning.
    """
    if not isinstance(name, str) or name not in COMPUTE_DTYPE_CHOICES:
        raise ValueError(f"compute_dtype must be one of {list(COMPUTE_DTYPE_CHOICES)}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if fast_dtype(torch.bfloat16, device) else torch.float32
    dtype = COMPUTE_DTYPES[name]
    if not fast_dtype(dtype, device):
        warnings.warn(
            f"compute_dtype={name!r}: device {torch.device(device)} has no fast {name} arithmetic, so it "
            "is emulated and runs slower than float32; use compute_dtype='auto' or 'float32'",
            RuntimeWarning,
            stacklevel=2,
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" / "bfloat16" / "float16" for a compute dtype."""
    return str(dtype).removeprefix("torch.")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of a model's floating-point parameters (float32 if it has none)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` itself if its weights are already ``dtype``, else a private deep copy cast to ``dtype``
    (eval mode). Parameters are cast on the way (no transient full-size copy); tied parameters stay tied;
    buffers such as the rotary ``inv_freq`` stay as they are (float32, as HF keeps them)."""
    if model_dtype(model) == dtype:
        return model
    memo: dict[int, object] = {
        id(param): nn.Parameter(param.detach().to(dtype), requires_grad=False)
        for param in model.parameters()
        if param.is_floating_point()
    }
    return copy.deepcopy(model, memo).eval()
