"""``apply_rope_into`` (into reused float32 buffers, reading keys of any dtype) against ``apply_rope``.

Injected: random keys [heads, T, d] in float32, float16 and bfloat16 (and a strided view of a larger
buffer), rotated twice into the same buffers. Must happen: the same bits as ``apply_rope`` of the keys
converted to float32, each time, and ``out`` itself is the result.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models.adapters import apply_rope, apply_rope_into


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_into_buffers_gives_apply_ropes_bits(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    out, scratch = torch.empty(3, 40, 64), torch.empty(3, 40, 64)
    for _ in range(2):
        x = torch.randn(3, 50, 64, generator=gen).to(dtype)[:, 5:45]  # a strided view, as cache rows are
        angles = torch.randn(40, 32, generator=gen)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
        want = apply_rope(x.float(), cos, sin)
        got = apply_rope_into(x, cos, sin, out, scratch)
        assert got is out
        assert torch.equal(got, want)
