"""``deviation``: CacheBlend's ranking: the reused rows whose fresh KV deviates most from the reused KV at
the check layer (query-blind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from semkv.reuse.selection.base import RowSelector, ScoreView

DEVIATION_ON: tuple[str, ...] = ("k", "v", "kv")


def check_deviation_on(value: object) -> str:
    if value not in DEVIATION_ON:
        raise ValueError(f"on must be one of {DEVIATION_ON} (which KV deviation ranks rows), got {value!r}")
    return str(value)


@dataclass(frozen=True)
class DeviationSelector(RowSelector):
    """on: compare keys ("k", LMCache v1; the default), values ("v", the paper's code) or both ("kv").
    The three were about as close to full prefill (docs/history/measurements.md)."""

    name: ClassVar[str] = "deviation"
    uses_deviation: ClassVar[bool] = True

    on: str = "k"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_deviation_on(self.on)

    def score(self, view: ScoreView) -> Tensor:
        return view.deviation(self.on)
