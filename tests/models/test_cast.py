"""``cache.cast`` against torch's direct conversion, over every 16-bit pattern.

Injected: all 65,536 float16 bit patterns cast to bfloat16, and all bfloat16 patterns cast to float16
(infinities, NaNs, subnormals, overflow included). Must happen: the same bits as ``Tensor.to`` (NaNs:
NaN), so the KV the cache writes through the faster float32 route is exactly what it wrote before.
"""

from __future__ import annotations

import pytest
import torch

from semkv.models.cache import cast


@pytest.mark.parametrize(
    ("source", "target"), [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)]
)
def test_cast_between_half_types_gives_the_direct_conversion_bits(source, target):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(source)
    want, got = every.to(target), cast(every, target)
    assert got.dtype == target
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_cast_to_other_types_is_to():
    x = torch.randn(5, dtype=torch.bfloat16)
    assert cast(x, torch.float32).dtype == torch.float32 and cast(x, torch.bfloat16) is x
