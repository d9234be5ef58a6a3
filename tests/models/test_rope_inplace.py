"""``apply_rope_`` (in place, into a reused scratch buffer) against ``apply_rope``.

Injected: random float32 keys [heads, T, d] and rotary tables, rotated in place twice with the same
scratch. Must happen: the same bits as ``apply_rope`` each time, ``x`` itself is the result.
"""

from __future__ import annotations

import torch

from semkv.models.adapters import apply_rope, apply_rope_


def test_in_place_rope_gives_apply_ropes_bits():
    gen = torch.Generator().manual_seed(0)
    scratch = torch.empty(3, 40, 64)
    for _ in range(2):
        x = torch.randn(3, 40, 64, generator=gen)
        angles = torch.randn(40, 32, generator=gen)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
        want = apply_rope(x, cos, sin)
        got = apply_rope_(x, cos, sin, scratch)
        assert got is x
        assert torch.equal(got, want)
