"""Model adapters, the layer-wise runtime and model loading."""

from semkv.models.adapters import LlamaFamilyAdapter
from semkv.models.cache import KVCache
from semkv.models.kernels import attention
from semkv.models.loader import EMBEDDED, LoadedModel, load_model, model_fingerprint
from semkv.models.registry import adapter_for, supported_model_types
from semkv.models.runtime import KeyGatherer, RecomputeSelector, Runtime

__all__ = [
    "EMBEDDED",
    "KVCache",
    "KeyGatherer",
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
