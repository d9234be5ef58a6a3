"""Prefill paths. Importing this package registers every built-in path."""

from semkv.reuse import blend, full, prefix, share  # noqa: F401  (registration)
from semkv.reuse.base import (
    POST_PREFILL_HOOKS,
    REUSE_PATHS,
    Plan,
    PrefillContext,
    PrefillOutcome,
    Refusal,
    ReusePath,
    register_path,
)

__all__ = [
    "POST_PREFILL_HOOKS",
    "REUSE_PATHS",
    "Plan",
    "PrefillContext",
    "PrefillOutcome",
    "Refusal",
    "ReusePath",
    "register_path",
]
