"""FP8 e4m3 (ue8m0 block scales) and MXFP4 decoding against hand-computed values."""

from __future__ import annotations

import torch

from ds4serve.quant import dequant_fp4, dequant_fp8, e8m0_to_float, quant_fp4, quant_fp8


def _e8m0(exponents: list[int]) -> torch.Tensor:
    return torch.tensor(exponents, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_e8m0_is_a_power_of_two():
    assert e8m0_to_float(_e8m0([127, 128, 120, 0])).tolist() == [1.0, 2.0, 2.0**-7, 2.0**-127]


def test_fp8_block_scales_hand_values():
    # bit patterns: 0x38 = 1.0, 0xB8 = -1.0, 0x7E = 448 (largest finite), 0x80 = -0.0, 0x01 = 2^-9
    bits = torch.tensor([[0x38, 0xB8, 0x7E], [0x80, 0x01, 0x38], [0x38, 0x38, 0x38]], dtype=torch.uint8)
    weight = bits.view(torch.float8_e4m3fn)
    scale = _e8m0([127, 129, 126, 127]).view(2, 2)  # block scales 1, 4 / 0.5, 1
    out = dequant_fp8(weight, scale, block=(2, 2))
    expected = torch.tensor([[1.0, -1.0, 448.0 * 4], [-0.0, 2.0**-9, 4.0], [0.5, 0.5, 1.0]])
    assert torch.equal(out, expected)
    assert torch.signbit(out[1, 0])  # negative zero survives


def test_fp4_nibble_order_and_codes():
    # byte 0x71: low nibble 1 (0.5) is the first element, high nibble 7 (6.0) the second
    # byte 0x8F: low nibble F (-6.0), high nibble 8 (-0.0)
    packed = torch.tensor([[0x71, 0x8F] + [0x00] * 14], dtype=torch.uint8).view(torch.int8)
    out = dequant_fp4(packed, _e8m0([128]).view(1, 1))
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [1.0, 12.0, -12.0, -0.0]
    assert torch.signbit(out[0, 3])
    assert torch.count_nonzero(out[0, 4:]) == 0


def test_quantizers_round_trip_exactly_representable_values():
    w = torch.tensor([[0.5, -1.5, 3.0, 6.0] * 8, [-0.25, 0.75, -3.0, 1.0] * 8])
    packed, scale = quant_fp4(w)
    assert torch.equal(dequant_fp4(packed, scale), w)
    q, s = quant_fp8(w, (1, 16))
    assert torch.equal(dequant_fp8(q, s, (1, 16)), w)


def test_fp8_quantization_error_is_bounded():
    w = torch.randn(70, 90, generator=torch.Generator().manual_seed(0))
    q, s = quant_fp8(w, (32, 32))
    assert s.shape == (3, 3)
    rel = ((dequant_fp8(q, s, (32, 32)) - w).abs() / w.abs().clamp_min(1e-3)).median()
    assert rel < 0.05
