"""``apply_rope_into`` (float32 keys converted from any dtype, into reused float32 buffers, with the signed
sine table) and ``apply_rope_rolled`` (the decode step's rotation of queries and keys in one go) against
``apply_rope``.

Injected: random keys [heads, T, d] in float32, float16 and bfloat16 (and a strided view of a larger
buffer), rotated twice into the same buffers; for the rolled form, queries and keys of a decode step
([nh, B, d] / [kvh, B, d] transposed views of one projection, B = 1 and 3) rotated together. Must happen:
the same bits as ``apply_rope`` of the inputs converted to float32, each time, and ``out`` itself is the
result.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models.adapters import apply_rope, apply_rope_into, apply_rope_rolled, rope_sin_signed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_into_buffers_gives_apply_ropes_bits(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    out, scratch = torch.empty(3, 40, 64), torch.empty(3, 40, 64)
    for _ in range(2):
        x = torch.randn(3, 50, 64, generator=gen).to(dtype)[:, 5:45]  # a strided view, as cache rows are
        angles = torch.randn(40, 32, generator=gen)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
        want = apply_rope(x.float(), cos, sin)
        x32 = torch.empty(3, 40, 64).copy_(x)  # the loader's float32 copy of the keys
        got = apply_rope_into(x32, cos, rope_sin_signed(sin), out, scratch)
        assert got is out
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rolled_rope_of_queries_and_keys_together_gives_apply_ropes_bits(dtype: torch.dtype, rows: int):
    gen = torch.Generator().manual_seed(1)
    nh, kvh, d = 9, 3, 64
    heads = torch.randn(rows, nh + 2 * kvh, d, generator=gen).to(dtype)  # one qkv projection's output
    q, k = heads[:, :nh].transpose(0, 1), heads[:, nh : nh + kvh].transpose(0, 1)
    angles = torch.randn(rows, d // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    turned = apply_rope_rolled(torch.cat((q.float(), k.float())), cos, rope_sin_signed(sin))
    assert torch.equal(turned[:nh], apply_rope(q.float(), cos, sin))
    assert torch.equal(turned[nh:], apply_rope(k.float(), cos, sin))
