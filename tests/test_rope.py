"""RoPE written in place (a chunk's query and attention output) is the out-of-place rotation, stored into
the input's last channels only."""

from __future__ import annotations

import pytest
import torch

from ds4serve.config import RopeSpec
from ds4serve.kernels import regions
from ds4serve.model.rope import Rope


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("traced", [False, True], ids=["plain", "traced"])
def test_in_place_rotation_equals_the_concatenation_and_keeps_the_other_channels(inverse, traced):
    rope = Rope(RopeSpec(10000.0), 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 24, generator=gen).to(torch.bfloat16)
    cos, sin = rope.cos_sin(torch.arange(7, 12), torch.bfloat16)
    expected = Rope.apply.eager(x, cos, sin, inverse)
    target = x.clone()
    # traced: a region of its own (the model's compiles are counted elsewhere), functionalised as Inductor gets it
    rotate = regions.region(Rope.apply_in_place.eager, chunks=True) if traced else Rope.apply_in_place.eager
    with regions.forced("aot_eager"):
        out = rotate(target, cos, sin, inverse)
    assert out.data_ptr() == target.data_ptr()
    assert torch.equal(target, expected)
    assert torch.equal(target[..., :-8], x[..., :-8])
    assert not torch.equal(target[..., -8:], x[..., -8:])
