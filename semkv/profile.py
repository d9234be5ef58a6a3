"""Per-model defaults: the calibrated profile on disk and the typed defaults the engine applies.

``semkv calibrate`` measures, per model fingerprint, the smallest blend recompute ratio, share
ratio and sparse budget whose agreement with full prefill / dense decoding reaches a target, and
writes them as a **profile** ``<home>/profiles/<fingerprint>.json``. The engine loads the profile of
its fingerprint at start (:func:`find_profile`: the user's home first, then the profiles shipped in the
package, ``semkv/profiles/``, measured for the embedded models), turns it into :class:`EngineDefaults`
(:func:`defaults_from_profile`): the values used for every knob a request leaves unset, and
:func:`check_request` logs a warning when a request asks for less than the profile.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from semkv.request import DEFAULT_KV_BUDGET, GenerateRequest
from semkv.reuse.options import BlendConfig, ReuseOptions, ShareConfig
from semkv.sparse.base import Budget, SparsePolicy
from semkv.sparse.registry import AUTO, make_policy, validate_sparse

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
PROFILE_DIR = "profiles"
SHIPPED_PACKAGE = "semkv.profiles"  # profiles measured for the embedded models, shipped as package data
# the selector of profiles written before profiles recorded one (the blend default back then)
LEGACY_BLEND_SELECTOR = "deviation"


@dataclass(frozen=True)
class AutoSparse:
    """What ``sparse="auto"`` decodes with.

    policy: a policy name, or None for dense decoding. kv_budget: its budget. min_context: prompts
    shorter than this decode dense (where the profile did not measure sparse decode safe, or attention is
    too small a share of a step for it to pay). options: the policy's options (its dataclass fields, e.g.
    the probe's ``split_at``). min_kept_tokens: the budget's floor in tokens
    (``SparseConfig.min_kept_tokens``). min_new_tokens: requests allowing fewer new tokens decode dense
    (sparse decode's set-up — the prompt's queries captured at prefill, the policy's preparation — is
    paid back a few milliseconds per step, so a short answer would be slower than dense). dense_steps:
    decode steps a request takes densely before its sparse decoder is set up
    (``SparseConfig.dense_steps``): an answer ending within them pays no set-up. reason: why (shown in the
    generation's stats as ``sparse_auto``).
    """

    policy: str | None
    kv_budget: float | int = DEFAULT_KV_BUDGET
    min_context: int = 0
    reason: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    min_kept_tokens: int = 0
    min_new_tokens: int = 0
    dense_steps: int = 0

    def __post_init__(self) -> None:
        validate_sparse(self.policy, self.kv_budget)
        if self.policy == AUTO:
            raise ValueError("sparse_auto.policy must name a policy (or be null for dense), not 'auto'")
        Budget(self.kv_budget, self.min_kept_tokens)  # a ValueError for a bad floor
        if not isinstance(self.options, dict):
            raise ValueError(f"sparse_auto.options must be a mapping, got {self.options!r}")
        if self.policy is not None:
            self.policy_object()  # a ValueError naming an unknown or bad option
        for name in ("min_context", "min_new_tokens", "dense_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"sparse_auto.{name} must be an int >= 0, got {value!r}")

    def policy_object(self) -> SparsePolicy | None:
        """A fresh policy with the calibrated options (None for dense); lists in JSON become tuples."""
        if self.policy is None:
            return None
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in self.options.items()}
        return make_policy(self.policy, **options)

    def config(self) -> dict[str, Any]:
        """The :class:`~semkv.sparse.decoder.SparseConfig` fields auto sets (the budget's floor, the dense
        steps before the set-up)."""
        fields = {"min_kept_tokens": self.min_kept_tokens, "dense_steps": self.dense_steps}
        return {name: value for name, value in fields.items() if value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AutoSparse:
        policy = data.get("policy")
        budget = data.get("kv_budget", DEFAULT_KV_BUDGET)
        return cls(
            policy=None if policy in (None, "dense") else str(policy),
            kv_budget=float(budget) if isinstance(budget, float) else int(budget),
            min_context=int(data.get("min_context", 0)),
            reason=str(data.get("reason", "")),
            options=data.get("options") or {},
            min_kept_tokens=data.get("min_kept_tokens", 0),
            min_new_tokens=data.get("min_new_tokens", 0),
            dense_steps=data.get("dense_steps", 0),
        )


NO_PROFILE_AUTO = AutoSparse(
    None, reason="no calibrated profile for this model (run `semkv calibrate`): dense decoding"
)


@dataclass(frozen=True)
class Profile:
    """A calibrated profile as read from disk.

    fingerprint: the model fingerprint it was measured on; target: the agreement it was chosen at.
    blend_recompute_ratio / share_ratio: the chosen ratios (None: not measured).
    blend_selector: the blend row selector the ratio was measured with (its ``describe()``), or None.
    kv_budget: sparse policy -> chosen budget. sparse_auto: what ``sparse="auto"`` resolves to (the best
    measured policy), or None when the profile did not measure it. path: the file it came from.
    data: the whole JSON document (measurements included). shipped: one of the package's own profiles
    (``semkv/profiles/``), not the user's.
    """

    fingerprint: str
    target: float
    blend_recompute_ratio: float | None = None
    blend_selector: dict[str, Any] | None = None
    share_ratio: float | None = None
    kv_budget: dict[str, float] = field(default_factory=dict)
    sparse_auto: AutoSparse | None = None
    path: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    shipped: bool = False

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str = "", shipped: bool = False) -> Profile:
        defaults = data.get("defaults", {})
        ratio = defaults.get("blend_recompute_ratio")
        selector = defaults.get("blend_selector")
        share = defaults.get("share_ratio")
        return cls(
            fingerprint=str(data["fingerprint"]),
            target=float(data.get("target", 0.0)),
            blend_recompute_ratio=None if ratio is None else float(ratio),
            blend_selector=dict(selector) if isinstance(selector, dict) else None,
            share_ratio=None if share is None else float(share),
            kv_budget={
                str(k): float(v) for k, v in (defaults.get("kv_budget") or {}).items() if v is not None
            },
            sparse_auto=AutoSparse.from_json(defaults["sparse_auto"])
            if defaults.get("sparse_auto")
            else None,
            path=path,
            data=data,
            shipped=shipped,
        )


def share_config_at(ratio: float) -> ShareConfig:
    """The share path's default config with its exponential schedule starting at ``ratio``; at ratio 1 every
    row through every layer, layer 0 included (``layer0_window`` 0: the exact end of the sweep)."""
    base = ShareConfig()
    window = 0 if ratio >= 1.0 else base.layer0_window
    return ShareConfig(first_ratio=ratio, min_ratio=min(base.min_ratio, ratio), layer0_window=window)


@dataclass(frozen=True)
class EngineDefaults:
    """What the engine uses for a knob a request leaves unset.

    blend / share: the configs of requests that give none (``recompute_ratio=`` still applies on top).
    kv_budget: sparse policy -> budget; a policy not listed gets ``DEFAULT_KV_BUDGET``.
    sparse_auto: what ``sparse="auto"`` resolves to (without a profile: dense, saying why).
    profile: the calibrated profile these came from, or None for the built-in defaults.
    """

    blend: BlendConfig = field(default_factory=BlendConfig)
    share: ShareConfig = field(default_factory=ShareConfig)
    kv_budget: dict[str, float | int] = field(default_factory=dict)
    sparse_auto: AutoSparse = NO_PROFILE_AUTO
    profile: Profile | None = None

    def reuse_options(self, request: GenerateRequest) -> ReuseOptions:
        """The request's reuse mode and configs: its own where given, else these defaults."""
        blend = request.blend if request.blend is not None else self.blend
        if request.recompute_ratio is not None:
            blend = replace(blend, recompute_ratio=float(request.recompute_ratio))
        share = request.share if request.share is not None else self.share
        return ReuseOptions(mode=request.reuse, blend=blend, share=share, namespace=request.namespace)

    def kv_budget_for(self, request: GenerateRequest) -> float | int:
        """The request's kv_budget, else the calibrated budget of its sparse policy, else the default."""
        if request.kv_budget is not None:
            return request.kv_budget
        policy = getattr(request.sparse, "name", request.sparse)
        return self.kv_budget.get(policy, DEFAULT_KV_BUDGET) if isinstance(policy, str) else DEFAULT_KV_BUDGET

    def resolve_sparse(
        self, request: GenerateRequest, prompt_tokens: int
    ) -> tuple[str | SparsePolicy | None, float | int, dict[str, Any], dict[str, Any]]:
        """(policy, kv_budget, notes, config) a request decodes with: ``sparse="auto"`` becomes the
        profile's best measured policy (with its calibrated options), budget and floor (dense without a
        profile, or below its ``min_context``; the notes say which and why; ``config``: the
        :class:`~semkv.sparse.decoder.SparseConfig` fields it sets); any other choice is the request's
        own, its budget per :meth:`kv_budget_for`."""
        if request.sparse != AUTO:
            return request.sparse, self.kv_budget_for(request), {}, {}
        auto = self.sparse_auto
        source = self._source()
        if auto.policy is not None and prompt_tokens < auto.min_context:
            why = (
                f"prompt of {prompt_tokens} tokens < {auto.min_context}, below which {source} did not "
                f"measure {auto.policy} safe: dense decoding"
            )
            return None, DEFAULT_KV_BUDGET, {"sparse_auto": why}, {}
        if auto.policy is not None and request.max_new_tokens < auto.min_new_tokens:
            why = (
                f"max_new_tokens {request.max_new_tokens} < {auto.min_new_tokens}: too few steps for "
                f"{auto.policy}'s set-up to pay back ({source}): dense decoding"
            )
            return None, DEFAULT_KV_BUDGET, {"sparse_auto": why}, {}
        budget = request.kv_budget if request.kv_budget is not None else auto.kv_budget
        chosen = auto.policy or "dense"
        reason = auto.reason or f"the calibrated profile's best policy: {chosen}"
        note = f"{chosen} @ {budget}: {reason}" + (f" ({source})" if self.profile is not None else "")
        return auto.policy_object(), budget, {"sparse_auto": note}, auto.config()

    def _source(self) -> str:
        """Where the profile came from, for the notes."""
        if self.profile is None:
            return "no calibrated profile"
        return "the shipped profile" if self.profile.shipped else "the calibrated profile"


def defaults_from_profile(profile: Profile | None) -> EngineDefaults:
    """The engine defaults a profile implies (the built-in ones for what it does not set)."""
    if profile is None:
        return EngineDefaults()
    blend = BlendConfig()
    if profile.blend_recompute_ratio is not None:
        # the ratio was measured with the profile's selector; profiles from before selectors measured
        # it with CacheBlend's deviation ranking (the default then)
        selector = profile.blend_selector if profile.blend_selector is not None else LEGACY_BLEND_SELECTOR
        blend = BlendConfig(recompute_ratio=profile.blend_recompute_ratio, selector=selector)
    share = share_config_at(profile.share_ratio) if profile.share_ratio is not None else ShareConfig()
    auto = profile.sparse_auto or AutoSparse(
        None,
        reason="the calibrated profile has no sparse_auto entry (re-run `semkv calibrate`): dense decoding",
    )
    return EngineDefaults(
        blend=blend, share=share, kv_budget=dict(profile.kv_budget), sparse_auto=auto, profile=profile
    )


# -- profile files ------------------------------------------------------------------------------------


def profile_path(home: Path, fingerprint: str) -> Path:
    return Path(home) / PROFILE_DIR / f"{fingerprint}.json"


def load_profile(home: Path, fingerprint: str) -> Profile | None:
    """The profile of ``fingerprint`` under ``home``, or None (missing, unreadable or another version)."""
    return _read_profile(profile_path(home, fingerprint), fingerprint)


def shipped_profile_folder() -> Path:
    """The package's folder of shipped profiles (``semkv/profiles/``)."""
    return Path(str(resources.files(SHIPPED_PACKAGE)))


def load_shipped_profile(fingerprint: str, folder: Path | None = None) -> Profile | None:
    """The shipped profile of ``fingerprint`` (``semkv/profiles/<fingerprint>.json``), or None."""
    path = (folder or shipped_profile_folder()) / f"{fingerprint}.json"
    return _read_profile(path, fingerprint, shipped=True)


def find_profile(home: Path, fingerprint: str, shipped_folder: Path | None = None) -> Profile | None:
    """The user's profile of ``fingerprint`` (``semkv calibrate`` wrote it under ``home``), else the
    package's shipped one, else None."""
    return load_profile(home, fingerprint) or load_shipped_profile(fingerprint, shipped_folder)


def _read_profile(path: Path, fingerprint: str, shipped: bool = False) -> Profile | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable calibration profile %s: %s", path, exc)
        return None
    if (
        not isinstance(data, dict)
        or data.get("version") != PROFILE_VERSION
        or data.get("fingerprint") != fingerprint
    ):
        log.warning("ignoring calibration profile %s: other version or fingerprint", path)
        return None
    try:
        return Profile.from_json(data, str(path), shipped=shipped)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring malformed calibration profile %s: %s", path, exc)
        return None


def write_profile(home: Path, data: dict[str, Any]) -> Path:
    """Write a profile document atomically (temp file + rename); returns its path."""
    path = profile_path(home, data["fingerprint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{time.time_ns()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)
    return path


# -- warnings ------------------------------------------------------------------------------------------


def _share_ratio(config: ShareConfig) -> float:
    return float(config.constant_ratio if config.schedule == "constant" else config.first_ratio)


def check_request(defaults: EngineDefaults, request: GenerateRequest) -> list[str]:
    """Warn (logging) for every knob ``request`` sets below the calibrated profile; return the messages."""
    profile = defaults.profile
    if profile is None:
        return []
    messages = []
    ratio = request.recompute_ratio
    if ratio is None and request.blend is not None:
        ratio = request.blend.recompute_ratio
    blend_min = profile.blend_recompute_ratio
    if (
        blend_min is not None
        and ratio is not None
        and request.reuse in ("blend", "auto")
        and ratio < blend_min
    ):
        messages.append(
            f"recompute_ratio {ratio} is below this model's calibrated {blend_min} "
            f"(top-1 agreement with full prefill < {profile.target})"
        )
    share_min = profile.share_ratio
    if share_min is not None and request.share is not None and request.reuse in ("share", "auto"):
        if _share_ratio(request.share) < share_min:
            messages.append(
                f"share recompute ratio {_share_ratio(request.share)} is below this model's calibrated {share_min}"
            )
    policy = getattr(request.sparse, "name", request.sparse)
    budget = request.kv_budget
    floor = profile.kv_budget.get(policy) if isinstance(policy, str) else None
    if floor is not None and isinstance(budget, float) and budget < floor:
        messages.append(f"kv_budget {budget} for sparse={policy!r} is below this model's calibrated {floor}")
    for message in messages:
        log.warning("%s (profile %s)", message, profile.path or profile.fingerprint[:12])
    return messages
