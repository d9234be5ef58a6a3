"""A generation request and its result.

``Engine.generate(**kwargs)`` builds a :class:`GenerateRequest` from its keyword
arguments, so every option is a validated dataclass field with one home.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

REUSE_MODES = ("auto", "none", "prefix", "share")
MAX_NEW_TOKENS_LIMIT = 8192


@dataclass
class GenerateRequest:
    """Everything one generation needs.

    prompt / messages: exactly one; a plain prompt is one user turn for chat models.
    chunks: context texts laid out before the prompt (inside the user turn).
    reuse: "auto" picks the path that reuses most; "none" forces full prefill.
    temperature: 0 = greedy; top_p: nucleus sampling when temperature > 0; seed: sampling seed.
    """

    prompt: str | None = None
    messages: Sequence[dict[str, str]] | None = None
    chunks: Sequence[str] = ()
    max_new_tokens: int = 64
    reuse: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True
    store_prompt: bool = True  # keep this prompt's KV in the store for later requests
    share: Any = None  # semkv.reuse.share.ShareConfig (or a dict of its fields) for reuse="share"/"auto"

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt= or messages=")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
        if self.prompt is not None and not self.prompt.strip() and not self.chunks:
            raise ValueError("prompt is empty")
        if isinstance(self.chunks, str):
            raise ValueError("chunks must be a list of strings, not one string")
        self.chunks = list(self.chunks or ())
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}"
            )
        if self.share is not None:
            from semkv.reuse.share import ShareConfig  # lazy: semkv.reuse imports this module

            self.share = ShareConfig(**self.share) if isinstance(self.share, dict) else self.share
            if not isinstance(self.share, ShareConfig):
                raise ValueError(f"share must be a ShareConfig or a dict, got {type(self.share).__name__}")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"unknown reuse mode {self.reuse!r}; choose one of {', '.join(REUSE_MODES)}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """What ``Engine.generate`` returns.

    text / token_ids: the generated tokens only.
    stats: ttft_s, decode_s, prompt_tokens, reused_tokens, recomputed_tokens, path, ... .
    first_logits: float32 logits [V] of the first generated token (for quality measures).
    """

    text: str
    token_ids: list[int]
    stats: dict[str, Any] = field(default_factory=dict)
    first_logits: Any = None
