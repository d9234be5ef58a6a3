"""``query`` and ``query+deviation``: rank the reused rows by the question's attention to them.

CacheBlend's deviation is query-blind: on small models it spends its budget on every chunk's first
tokens and on punctuation. A3 (arXiv 2511.17560) and ProphetKV (arXiv 2602.02579) rank context tokens
by the attention the *question* pays them instead. Here a probe pass runs first
(:class:`semkv.reuse.selective.QueryProbe`): only the uncached rows (template rest, separators, the
question and the generation prompt) go through the layers, over the reused chunk KV, and at each
probe layer the attention of the question rows (``RowInfo.query``) to every row is summed over heads
and question rows. The blend's check layer then keeps the rows with the most attention. Layers with a
sliding window are skipped by the probe (their queries cannot see most of the context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from semkv.reuse.selection.base import RowSelector, ScoreView, shares
from semkv.reuse.selection.deviation import check_deviation_on


def check_layers(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"layers must be a list of layer indices >= 1 or None, got {value!r}")
    layers = tuple(value)
    if not layers or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in layers):
        raise ValueError(f"layers must be a non-empty list of layer indices >= 1 or None, got {value!r}")
    return tuple(sorted(set(layers)))


@dataclass(frozen=True)
class QuerySelector(RowSelector):
    """layers: the probe layers whose question attention is summed; None = ``global_layers``, or with that
    None too every layer from 1 up to ``depth`` x the model's layers. Indices past the last layer and
    sliding-window layers are left out (if that leaves none: the first global layer).
    global_layers: used when ``layers`` is None: the first ``global_layers`` global (full-attention) layers
    from layer 1 on; None = by ``depth``. The probe pass stops after its last layer, so its cost grows
    with the depth it reaches: at 4K tokens on SmolLM2 (30 layers, all global) ~0.175 s through every
    layer, ~0.05 s through 8, ~0.026 s through 4, of a ~1.4-1.7 s blend. 8 by default, chosen on the
    HotpotQA dev split (SmolLM2 bf16, ratio 0.15, 21 questions): median TTFT 1.42 s against 1.54 s for
    every layer (full prefill 6.16 s), first-token KL to full prefill 0.096 against 0.073 (2 layers: 0.122,
    4: 0.109, at the same TTFT within the noise), F1 too close to call at that n. On Gemma 3, whose
    global layers are 5, 11 and 17, any count >= 3 is every one of them (its default is unchanged).
    depth: used when ``layers`` and ``global_layers`` are None, in (0, 1] (0.5 on Gemma 3 probes layer 5
    alone).
    keep_probe_rows: the uncached rows other than the question (template rest, the separators between
    chunks) keep the KV the probe computed for them, over the chunks' reused KV, instead of being
    recomputed over the refreshed rows (only when the probe ran through the last layer). It saves a
    little TTFT but took the blend much further from full prefill on the dev split, so it is off by
    default: the separators matter."""

    name: ClassVar[str] = "query"
    needs_probe: ClassVar[bool] = True

    layers: tuple[int, ...] | None = None
    global_layers: int | None = 8
    depth: float = 1.0
    keep_probe_rows: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layers", check_layers(self.layers))
        if self.global_layers is not None and (
            isinstance(self.global_layers, bool)
            or not isinstance(self.global_layers, int)
            or self.global_layers < 1
        ):
            raise ValueError(f"global_layers must be an integer >= 1 or None, got {self.global_layers!r}")
        if not isinstance(self.keep_probe_rows, bool):
            raise ValueError(f"keep_probe_rows must be true or false, got {self.keep_probe_rows!r}")
        if (
            isinstance(self.depth, bool)
            or not isinstance(self.depth, (int, float))
            or not 0 < self.depth <= 1
        ):
            raise ValueError(f"depth must be a number in (0, 1], got {self.depth!r}")

    def probe_layers(self, windows: Sequence[int | None]) -> tuple[int, ...]:
        """The probe layers on a model whose layer ``i`` has sliding window ``windows[i]`` (None: global):
        ``layers`` (or the first ``global_layers`` global layers from 1, or 1 .. depth x layers) without the
        windowed ones; the first global layer if none is left."""
        num_layers = len(windows)
        if self.layers is not None:
            wanted = [x for x in self.layers if x < num_layers]
        elif self.global_layers is not None:
            wanted = [x for x in range(1, num_layers) if windows[x] is None][: self.global_layers]
        else:
            wanted = list(range(1, max(1, min(num_layers - 1, round(self.depth * num_layers))) + 1))
        picked = tuple(x for x in wanted if windows[x] is None)
        if picked:
            return picked
        globals_ = [x for x in range(1, num_layers) if windows[x] is None]
        return (globals_[0] if globals_ else num_layers - 1,)

    @property
    def keeps_probe_rows(self) -> bool:
        return self.keep_probe_rows

    def score(self, view: ScoreView) -> Tensor:
        return view.probe_scores()


@dataclass(frozen=True)
class QueryDeviationSelector(QuerySelector):
    """The question's attention and the KV deviation, each as a share of its total over the candidates,
    mixed: ``weight`` x attention + (1 - weight) x deviation. on: which deviation ("k", "v", "kv")."""

    name: ClassVar[str] = "query+deviation"
    uses_deviation: ClassVar[bool] = True

    weight: float = 0.5
    on: str = "k"

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.weight, bool)
            or not isinstance(self.weight, (int, float))
            or not 0 <= self.weight <= 1
        ):
            raise ValueError(f"weight must be a number in [0, 1], got {self.weight!r}")
        check_deviation_on(self.on)

    def score(self, view: ScoreView) -> Tensor:
        attention = shares(view.probe_scores())
        return self.weight * attention + (1 - self.weight) * shares(view.deviation(self.on))
