"""A generation request and its result.

``Engine.generate(**kwargs)`` builds a :class:`GenerateRequest` from its keyword
arguments, so every option is a validated dataclass field with one home.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from semkv.prompt import PromptLayout
from semkv.reuse.options import BlendConfig, ReuseOptions, ShareConfig, check_fraction
from semkv.reuse.registry import REUSE_MODES
from semkv.sparse import SparsePolicy, validate_sparse
from semkv.store.keys import EntryKey, Namespace

MAX_NEW_TOKENS_LIMIT = 8192
DEFAULT_KV_BUDGET = 0.1
# A stop string's length in characters. The stream holds back text that may be a stop string's start
# (up to its length - 1 characters) and builds a matcher of its length once per request; a stop string is
# a delimiter, and 1,000 characters leave room for any a client has reason to send.
MAX_STOP_CHARS = 1000


@dataclass
class GenerateRequest:
    """Everything one generation needs.

    prompt / messages: exactly one; a plain prompt is one user turn for chat models.
    chunks: context texts laid out before the prompt (inside the user turn).
    reuse: "auto" picks the path that reuses most; "none" forces full prefill.
    temperature: 0 = greedy; top_p: nucleus sampling when temperature > 0; seed: sampling seed.
    stop: strings that end the generation when the text produces one (not part of the returned text).
    use_chat_template: None = wrap a prompt in the tokenizer's chat template when it has one;
        False = the prompt is plain text (a completion); True = require the template.
    assistant_prefix: text the reply starts with (e.g. "The answer is"), placed after the chat
        template's generation prompt (after a plain prompt without the template); the generated
        text continues it and does not repeat it.
    repair_loops: an answer decoded from inexact reused KV (blend, share) that starts repeating itself is
        recomputed exactly once and re-decoded from what the client has received (see
        :mod:`semkv.loop_repair`); False keeps whatever the reused KV decodes.
    tenant / cache_salt: the request's namespace (see :class:`semkv.store.keys.Namespace`): only
        requests with the same tenant and salt reuse each other's KV (prefix blocks, chunks, shared
        prompts). The server sets ``tenant`` from the API key; "" / None is the default namespace.
    """

    prompt: str | None = None
    messages: Sequence[dict[str, str]] | None = None
    chunks: Sequence[str] = ()
    use_chat_template: bool | None = None
    assistant_prefix: str = ""
    max_new_tokens: int = 64
    reuse: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True
    stop: Sequence[str] = ()
    store_prompt: bool = True  # keep this prompt's KV in the store for later requests
    share: ShareConfig | dict | None = None  # reuse="share"/"auto" options (or a dict of its fields)
    recompute_ratio: float | None = None  # reuse="blend": fraction of cached chunk tokens recomputed
    blend: BlendConfig | dict | None = None  # reuse="blend"/"auto" options (or a dict of its fields)
    # "auto": the policy and budget the model's calibrated profile measured best (dense without a
    # profile, or for prompts below its min_context); None/"dense"; a name in semkv.sparse.POLICIES; a policy
    sparse: str | SparsePolicy | None = "auto"
    kv_budget: float | int | None = None  # sparse decode: a fraction of the context or a token count;
    # None = the model's calibrated budget for the policy (``semkv calibrate``), else 0.1
    sparse_reselect_every: int | None = None  # sparse decode: choose blocks at most every k decode steps
    # (1: every step, the seed's Key-Key; 2: the conservative setting); None = the decoder's default (4)
    repair_loops: bool = True
    tenant: str = ""
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt= or messages=")
        _check_inputs(self.prompt, self.messages, self.chunks)
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValueError(f"prompt must be a str, got {type(self.prompt).__name__}")
        if self.prompt is not None and not self.prompt.strip() and not self.chunks:
            raise ValueError("prompt is empty")
        if isinstance(self.chunks, str):
            raise ValueError("chunks must be a list of strings, not one string")
        self.chunks = list(self.chunks or ())
        self.stop = _check_stop(self.stop)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens must be in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens}"
            )
        if self.share is not None:
            self.share = ShareConfig(**self.share) if isinstance(self.share, dict) else self.share
            if not isinstance(self.share, ShareConfig):
                raise ValueError(f"share must be a ShareConfig or a dict, got {type(self.share).__name__}")
        if self.recompute_ratio is not None:
            check_fraction("recompute_ratio", self.recompute_ratio)
        if self.blend is not None:
            self.blend = BlendConfig(**self.blend) if isinstance(self.blend, dict) else self.blend
            if not isinstance(self.blend, BlendConfig):
                raise ValueError(f"blend must be a BlendConfig or a dict, got {type(self.blend).__name__}")
        validate_sparse(
            None if isinstance(self.sparse, SparsePolicy) else self.sparse,
            DEFAULT_KV_BUDGET if self.kv_budget is None else self.kv_budget,
            self.sparse_reselect_every,
        )
        _check_text("assistant_prefix", self.assistant_prefix)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {type(self.cache_salt).__name__}")
        Namespace(self.tenant, self.cache_salt or "")  # a ValueError naming tenant / salt
        if self.use_chat_template is not None and not isinstance(self.use_chat_template, bool):
            raise ValueError(f"use_chat_template must be None, True or False, got {self.use_chat_template!r}")
        if self.use_chat_template is False and self.messages is not None:
            raise ValueError("messages need the chat template; give prompt= for plain text")
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"unknown reuse mode {self.reuse!r}; choose one of {', '.join(REUSE_MODES)}")
        _check_number("temperature", self.temperature)
        _check_number("top_p", self.top_p)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.stop_at_eos, bool) or not isinstance(self.store_prompt, bool):
            raise ValueError("stop_at_eos and store_prompt must be true or false")
        if not isinstance(self.repair_loops, bool):
            raise ValueError(f"repair_loops must be true or false, got {self.repair_loops!r}")

    @property
    def namespace(self) -> Namespace:
        """The namespace whose cache this request reads and writes."""
        return Namespace(self.tenant, self.cache_salt or "")

    def text_chars(self) -> int:
        """Characters of user text the prompt is made of: the prompt or every message's content, the
        chunks and the reply's start (what :meth:`semkv.engine.Engine.max_prompt_chars` bounds)."""
        if self.messages is not None:
            body = sum(len(m.get("content") or "") for m in self.messages)
        else:
            body = len(self.prompt or "")
        return body + sum(len(c) for c in self.chunks) + len(self.assistant_prefix)


@dataclass(frozen=True)
class ResolvedRequest:
    """A request as the engine runs it, resolved once when it is admitted (:meth:`Engine.resolve
    <semkv.engine.Engine.resolve>`): everything planning, prefill, the scheduler and the store read.

    request: the request as given (``max_new_tokens`` fitted to the context where the caller asked).
    layout: the prompt as tokenized segments; token_ids: all of its token ids, in order.
    options: the reuse mode and the blend / share configs after the engine's defaults and profile,
        with the request's namespace.
    sparse_policy / kv_budget / sparse_notes: the sparse decode the request gets (``sparse="auto"``
        resolved for this prompt's length; the notes say what auto chose and why); sparse_config: the
        further ``SparseConfig`` fields it decodes with (auto's calibrated budget floor).
    prefix_keys: the chained keys of the prompt's full blocks of ``block_size`` tokens in its namespace,
        when it may reuse a stored prefix (empty under ``reuse="none"`` or without the prefix path).
    """

    request: GenerateRequest
    layout: PromptLayout
    token_ids: tuple[int, ...]
    options: ReuseOptions
    sparse_policy: str | SparsePolicy | None
    kv_budget: float | int
    sparse_notes: dict[str, Any]
    prefix_keys: tuple[EntryKey, ...]
    block_size: int
    sparse_config: dict[str, Any] = field(default_factory=dict)

    @property
    def namespace(self) -> Namespace:
        return self.options.namespace

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def stop(self) -> Sequence[str]:
        return self.request.stop


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


def _check_text(name: str, value: object) -> None:
    """A str that is valid Unicode text (no lone surrogates, e.g. from undecodable bytes)."""
    if isinstance(value, (bytes, bytearray)):
        raise ValueError(f"{name} must be text (str), got bytes; decode it first, e.g. data.decode('utf-8')")
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode text: character {exc.object[exc.start]!r} at position {exc.start} "
            "(bytes that were not UTF-8?)"
        ) from None


def _check_inputs(prompt: object, messages: object, chunks: object) -> None:
    if prompt is not None:
        _check_text("prompt", prompt)
    if messages is not None:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
                raise ValueError(
                    f"messages[{i}] must be a dict with 'role' and 'content', got {message!r:.80}"
                )
            if message.get("role") not in ("system", "user", "assistant"):
                raise ValueError(
                    f"messages[{i}] has role {message.get('role')!r}; use system, user or assistant"
                )
            _check_text(f"messages[{i}]['content']", message.get("content"))
    if chunks is not None and not isinstance(chunks, (str, bytes)):
        if not isinstance(chunks, Sequence):
            raise ValueError(f"chunks must be a list of strings, got {type(chunks).__name__}")
        for i, chunk in enumerate(chunks):
            _check_text(f"chunks[{i}]", chunk)


def _check_stop(stop: object) -> list[str]:
    """Stop strings as a list (one string is one stop string); each a non-empty str."""
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or isinstance(stop, bytes):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r:.80}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop[{i}] has {len(s)} characters; a stop string may have at most {MAX_STOP_CHARS}"
            )
    return list(stop)


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")


AnyRequest = GenerateRequest | ResolvedRequest  # a request as given, or resolved ahead of time
