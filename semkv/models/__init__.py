"""Model adapters, the layer-wise runtime and model loading."""

from semkv.models.adapters import LlamaFamilyAdapter, adapter_for, supported_model_types
from semkv.models.cache import KVCache
from semkv.models.loader import EMBEDDED, LoadedModel, load_model, model_fingerprint
from semkv.models.runtime import KeySelector, RecomputeSelector, Runtime, attention

__all__ = [
    "EMBEDDED",
    "KVCache",
    "KeySelector",
    "LlamaFamilyAdapter",
    "LoadedModel",
    "RecomputeSelector",
    "Runtime",
    "adapter_for",
    "attention",
    "load_model",
    "model_fingerprint",
    "supported_model_types",
]
