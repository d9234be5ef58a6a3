"""semkv: a KV-cache engine that reuses and selects KV cache by meaning.

import semkv
engine = semkv.Engine.from_pretrained()
g = engine.generate(prompt="...", max_new_tokens=64)
"""

import logging

from semkv.config import EngineConfig, StoreConfig, default_home
from semkv.engine import Engine
from semkv.request import GenerateRequest, Generation
from semkv.reuse.options import BlendConfig, ShareConfig
from semkv.sequence import Sequence

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"
__all__ = [
    "BlendConfig",
    "Engine",
    "EngineConfig",
    "GenerateRequest",
    "Generation",
    "Sequence",
    "ShareConfig",
    "StoreConfig",
    "default_home",
]
