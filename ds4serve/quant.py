"""Exact decoding (and, for tiny checkpoints, encoding) of the checkpoint's quantized formats.

* FP8: ``float8_e4m3fn`` weights with one ``ue8m0`` scale (a power of two, 2^(e-127)) per
  ``block = (rows, cols)`` tile; the last tiles may be partial.
* MXFP4: two e2m1 codes per int8 byte, the low nibble is the even (first) element; one ue8m0
  scale per 32 consecutive inputs of a row.

Dequantising either to bf16 or fp32 is exact: a power-of-two scale times a code of at most three
mantissa bits fits both. :class:`FP8Weight` and :class:`FP4Weight` hold such weights as the model and the
kernels read them; their ``dequantize`` is the torch reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FP4_BLOCK = 32
# e2m1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (as ``float8_e8m0fnu`` or raw uint8 exponents) to fp32 powers of two."""
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        return scale.float()
    return torch.ldexp(
        torch.ones(scale.shape, dtype=torch.float32, device=scale.device), scale.to(torch.int32) - 127
    )


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two to ``float8_e8m0fnu``."""
    exponent = torch.log2(scale.float()).round().to(torch.int32) + 127
    return exponent.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    expanded = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return expanded[:rows, :cols]


def dequant_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """FP8 e4m3 weight ``[..., out, in]`` times its block scales ``[..., ceil(out/b0), ceil(in/b1)]``."""
    if weight.dim() == 3:
        return torch.stack([dequant_fp8(w, s, block, dtype) for w, s in zip(weight, scale)])
    expected = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {block}: expected {expected}"
        )
    return (weight.float() * _expand_blocks(e8m0_to_float(scale), weight.shape, block)).to(dtype)


def quant_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to FP8 e4m3 with power-of-two block scales (tiny checkpoints only)."""
    rows, cols = weight.shape
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(br * block[0], bc * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(br, block[0], bc, block[1]).abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(tiles / FP8_MAX)))
    q = (weight.float() / _expand_blocks(scale, weight.shape, block)).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(scale)


@functools.cache
def _fp4_table(device: torch.device) -> torch.Tensor:
    """The e2m1 code values on ``device``, made once: a copy from the host on every call would be a
    synchronisation a CUDA graph cannot capture."""
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def dequant_fp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 ``[..., out, in/2]`` int8 with scales ``[..., out, in/32]`` to ``[..., out, in]``."""
    raw = packed.view(torch.uint8)
    lut = _fp4_table(packed.device)
    low, high = lut[(raw & 0x0F).long()], lut[(raw >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)
    expected = (*values.shape[:-1], values.shape[-1] // FP4_BLOCK)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"MXFP4 scale shape {tuple(scale.shape)} does not match weight of {values.shape[-1]} "
            f"inputs per row: expected {expected}"
        )
    factors = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=-1)
    return (values * factors).to(dtype)


def quant_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[out, in]`` to MXFP4 (round to nearest code; tiny checkpoints only)."""
    out, inp = weight.shape
    if inp % FP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {FP4_BLOCK}, got {inp}")
    w = weight.float().view(out, inp // FP4_BLOCK, FP4_BLOCK)
    scale = torch.exp2(torch.ceil(torch.log2(w.abs().amax(-1).clamp_min(1e-30) / 6.0)))
    scaled = (w / scale.unsqueeze(-1)).reshape(out, inp)
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    codes = codes | ((scaled < 0).to(torch.uint8) << 3)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, float_to_e8m0(scale)


@dataclass
class FP8Weight:
    data: torch.Tensor  # float8_e4m3fn [..., out, in]
    scale: torch.Tensor  # fp32 [..., ceil(out/b0), ceil(in/b1)]
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequant_fp8(self.data, self.scale, self.block, dtype)

    def __getitem__(self, e: int | slice) -> "FP8Weight":
        return FP8Weight(self.data[e], self.scale[e], self.block)


@dataclass
class FP4Weight:
    data: torch.Tensor  # int8 [..., out, in/2], low nibble = even input
    scale: torch.Tensor  # uint8 e8m0 exponents [..., out, in/32]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.data.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequant_fp4(self.data, self.scale, dtype)

    def __getitem__(self, e: int | slice) -> "FP4Weight":
        return FP4Weight(self.data[e], self.scale[e])


# A weight as the model holds it: dense (bf16 / fp32), FP8 with block scales, or MXFP4.
Weight = torch.Tensor | FP8Weight | FP4Weight


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> FP8Weight:
    """Quantize a dense ``[out, in]`` (or stacked ``[E, out, in]``) weight on its own device."""
    if w.dim() == 3:
        parts = [quantize_fp8(m, block) for m in w]
        return FP8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]), block)
    rows, cols = w.shape
    br, bc = -(-rows // block[0]), -(-cols // block[1])
    padded = w.new_zeros((br * block[0], bc * block[1]), dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    amax = padded.view(br, block[0], bc, block[1]).abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return FP8Weight((w.float() / full).to(torch.float8_e4m3fn), scale, block)


def fp8_from_checkpoint(
    data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], device: torch.device | str
) -> FP8Weight:
    """An :class:`FP8Weight` from stored e4m3 data and ue8m0 scales."""
    return FP8Weight(data.to(device), e8m0_to_float(scale).to(device), block)


def fp4_from_checkpoint(data: torch.Tensor, scale: torch.Tensor, device: torch.device | str) -> FP4Weight:
    """An :class:`FP4Weight` from stored packed codes and ue8m0 scales (kept as uint8 exponents)."""
    exps = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale.to(torch.uint8)
    return FP4Weight(data.view(torch.int8).to(device), exps.to(device))
