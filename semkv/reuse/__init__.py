"""Prefill paths: full prefill, exact prefix reuse, CacheBlend (blend), SemShareKV (share).

One module per path behind :class:`semkv.reuse.base.ReusePath`; the engine builds its own
instances with :func:`semkv.reuse.registry.build_paths`. This package module imports nothing, so
importing one path never loads the others.
"""
