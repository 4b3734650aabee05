"""The one-pass dequantisation kernels equal the torch references exactly (every value is a code
times a power of two), for single and stacked matrices, fp32 and bf16 outputs, and block edges."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the kernels cannot run (CPU CI installs it)")

from ds4serve import quant  # noqa: E402
from ds4serve.kernels import dequant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(40, 96), (3, 20, 64)], ids=["matrix", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_dequant_equals_reference(shape, dtype):
    gen = torch.Generator().manual_seed(1)
    *lead, out, inp = shape
    packed = torch.randint(-128, 128, (*lead, out, inp // 2), generator=gen, dtype=torch.int8)
    scale = torch.randint(110, 140, (*lead, out, inp // 32), generator=gen, dtype=torch.uint8)
    packed[..., 0, 0] = 0x08  # low nibble -0, high nibble 0
    packed[..., 0, 1] = -1  # 0xFF: both nibbles code 15 (-6)
    ref = quant.dequant_fp4(packed, scale, dtype)
    got = dequant.dequant_fp4(packed.to(DEVICE), scale.to(DEVICE), dtype).cpu()
    assert got.dtype == dtype and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))  # -0 stays -0


@pytest.mark.parametrize(
    "shape,block",
    [((40, 96), (16, 32)), ((37, 80), (16, 32)), ((2, 32, 64), (16, 32)), ((2, 20, 64), (16, 32))],
    ids=["matrix", "partial-blocks", "stacked", "stacked-partial-blocks"],
)
@pytest.mark.parametrize("scale_kind", ["fp32", "e8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dequant_equals_reference(shape, block, scale_kind, dtype):
    gen = torch.Generator().manual_seed(2)
    *lead, out, inp = shape
    weight = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (*lead, -(-out // block[0]), -(-inp // block[1]))
    exponents = torch.randint(115, 135, blocks, generator=gen, dtype=torch.uint8)
    scale = exponents if scale_kind == "e8m0" else quant.e8m0_to_float(exponents)
    ref = quant.dequant_fp8(weight, scale, block, dtype)
    got = dequant.dequant_fp8(weight.to(DEVICE), scale.to(DEVICE), block, dtype).cpu()
    assert got.dtype == dtype and torch.equal(got, ref)


def test_shape_mismatches_are_refused():
    with pytest.raises(ValueError, match="MXFP4 scale shape"):
        dequant.dequant_fp4(
            torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8), torch.float32
        )
    with pytest.raises(ValueError, match="FP8 scale shape"):
        dequant.dequant_fp8(
            torch.zeros(4, 64).to(torch.float8_e4m3fn), torch.ones(1, 1), (16, 32), torch.float32
        )
