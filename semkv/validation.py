"""Checks of configuration values that give a ValueError naming the field (bools are never numbers).

Every knob a request can set is bounded here, so a value a client sends can neither crash the
engine nor make it allocate without limit (``tables=10**7`` would ask for terabytes of hyperplanes).
"""

from __future__ import annotations

import math


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in [low, high]; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r:.40}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def check_number(name: str, value: object, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a finite float in [low, high] (or (low, high] with ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
    if value < low or value > high or (low_open and value == low):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return float(value)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r:.40}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r:.40}")
    return value
