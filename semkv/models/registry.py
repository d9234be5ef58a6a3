"""The family adapters semkv can run, by HF ``model_type``."""

from __future__ import annotations

from semkv.models.adapters import LlamaFamilyAdapter
from semkv.models.gemma3 import Gemma3Adapter

ADAPTERS: tuple[type[LlamaFamilyAdapter], ...] = (LlamaFamilyAdapter, Gemma3Adapter)


def supported_model_types() -> list[str]:
    return sorted(t for adapter in ADAPTERS for t in adapter.model_types)


def adapter_for(model_type: str) -> type[LlamaFamilyAdapter]:
    """The adapter class for a HF ``model_type``; a clear error for anything else."""
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    raise ValueError(
        f"unsupported model architecture {model_type!r}; semkv supports: {', '.join(supported_model_types())}"
    )
