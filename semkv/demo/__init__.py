"""``semkv demo``: the main job on the embedded defaults, one scene per technique.

A scene is a module in this package with ``TITLE: str`` and ``run(engine) -> dict``
(it prints for a person and returns its figures). Scenes run in ``SCENES`` order.
"""

from __future__ import annotations

import importlib
import importlib.util
import time

SCENES: list[str] = ["prefix", "blend", "share", "sparse"]


def available_scenes() -> list[str]:
    return [s for s in SCENES if importlib.util.find_spec(f"semkv.demo.{s}") is not None]


def run_demo(engine, scenes: list[str] | None = None) -> dict[str, dict]:
    chosen = scenes or available_scenes()
    unknown = [s for s in chosen if s not in available_scenes()]
    if unknown:
        raise ValueError(f"unknown demo scene(s) {unknown}; available: {available_scenes()}")
    results = {}
    print(f"semkv demo on {engine.name} (KV {engine.kv_dtype}, block {engine.block_size})")
    for number, name in enumerate(chosen, 1):
        module = importlib.import_module(f"semkv.demo.{name}")
        print(f"\n=== scene {number}/{len(chosen)}: {module.TITLE} ===")
        start = time.perf_counter()
        results[name] = module.run(engine)
        print(f"(scene took {time.perf_counter() - start:.1f} s)")
    return results
