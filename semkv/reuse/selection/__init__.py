"""Which reused rows a selective recompute (CacheBlend, SemShareKV) recomputes: one small dataclass per
policy behind :class:`semkv.reuse.selection.base.RowSelector`, by name in
:mod:`semkv.reuse.selection.registry`. This package module imports nothing."""
