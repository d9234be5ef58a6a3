"""Calibrated profiles shipped with semkv, one ``<fingerprint>.json`` per embedded model (package data).

The engine reads the user's own profile (``<home>/profiles/``, written by ``semkv calibrate``) first and
one of these only when the user has none (:func:`semkv.profile.find_profile`). How each was chosen is in
its ``measurements`` and ``reason`` (docs/benchmarks.md, "Sparse decode").
"""
