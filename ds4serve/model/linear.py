"""Weights that may stay quantized on the GPU, and the projections that read them.

A weight is a dense tensor (bf16 / fp32), an :class:`FP8Weight` (e4m3 with fp32 block scales)
or an :class:`FP4Weight` (MXFP4: packed e2m1 pairs with uint8 e8m0 exponents per 32 inputs).
:func:`linear` and :func:`grouped_linear` read FP8 (and, with ``SWITCHES.gemv_dense``, dense bf16)
weights in place through the Triton GEMV for a few rows on CUDA (decode); otherwise they dequantise
exactly and run the dense product, which is the reference the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels.switches import SWITCHES
from ..quant import dequant_fp4, dequant_fp8, e8m0_to_float

GEMV_MAX_ROWS = 8  # up to this many activation rows (tokens), projections run as GEMV kernels
FP8_GEMV_MAX_ROWS = (
    16  # FP8 weights times bf16 activations: the tensor-core GEMV tile's width (gemv.DOT_ROWS)
)


@dataclass
class FP8Weight:
    data: torch.Tensor  # float8_e4m3fn [..., out, in]
    scale: torch.Tensor  # fp32 [..., ceil(out/b0), ceil(in/b1)]
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if _dequant_kernel_applies(self.data):
            from ..kernels import dequant

            return dequant.dequant_fp8(self.data, self.scale, self.block, dtype)
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
        if _dequant_kernel_applies(self.data):
            from ..kernels import dequant

            return dequant.dequant_fp4(self.data, self.scale, dtype)
        return dequant_fp4(self.data, self.scale, dtype)

    def __getitem__(self, e: int | slice) -> "FP4Weight":
        return FP4Weight(self.data[e], self.scale[e])


Weight = torch.Tensor | FP8Weight | FP4Weight


def _dequant_kernel_applies(data: torch.Tensor) -> bool:
    """One-pass dequantisation (``SWITCHES.dequant_kernel``) outside compiled regions, where Inductor
    fuses the torch reference into its neighbours instead."""
    return SWITCHES.dequant_kernel and kernels.enabled(data) and not torch.compiler.is_compiling()


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a dense tensor of ``dtype`` (a no-op for dense weights)."""
    return w if isinstance(w, torch.Tensor) else w.dequantize(dtype)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` for a dense or quantized weight ``w [out, in]``."""
    if _gemv_applies(x, w, 1):
        return _gemv(x, w, 1).view(*x.shape[:-1], w.shape[0])
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    return F.linear(x, w.dequantize(x.dtype))


def linear_pair(x: torch.Tensor, a: Weight, b: Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(x, a), linear(x, b))``; with ``SWITCHES.gemv_pair``, when both run as GEMVs, one call of
    :func:`ds4serve.kernels.gemv.gemv_pair` (one launch where the two products' tiles allow)."""
    if SWITCHES.gemv_pair and _gemv_applies(x, a, 1) and _gemv_applies(x, b, 1):
        from ..kernels import ops

        ya, yb = ops.gemv_pair(x.reshape(-1, x.shape[-1]), *_operand(a), *_operand(b))
        return ya.view(*x.shape[:-1], a.shape[0]), yb.view(*x.shape[:-1], b.shape[0])
    return linear(x, a), linear(x, b)


def grouped_linear(x: torch.Tensor, w: Weight, groups: int) -> torch.Tensor:
    """``x [S, G, K]`` times ``w [G*R, K]``, group g using rows ``[gR, (g+1)R)``: ``[S, G*R]``."""
    S = x.shape[0]
    if _gemv_applies(x, w, groups):
        return _gemv(x, w, groups)
    wd = dense(w, x.dtype)
    return torch.einsum("sgi,gri->sgr", x, wd.view(groups, wd.shape[0] // groups, -1)).reshape(S, -1)


def _gemv_applies(x: torch.Tensor, w: Weight, groups: int) -> bool:
    """The Triton GEMV takes up to ``GEMV_MAX_ROWS`` tokens on contiguous dense bf16 weights times bf16
    activations while ``SWITCHES.gemv_dense`` is on (else cuBLAS), and on FP8 weights; FP8 with bf16
    activations up to ``FP8_GEMV_MAX_ROWS``, on tensor-core tiles past 8 (a wider verify block's
    projections would otherwise dequantise every weight to bf16 and read it again)."""
    rows = x.numel() // (x.shape[-1] * groups)
    if not kernels.enabled(x):
        return False
    if isinstance(w, FP8Weight):
        return rows <= (FP8_GEMV_MAX_ROWS if x.dtype == torch.bfloat16 else GEMV_MAX_ROWS)
    return (
        rows <= GEMV_MAX_ROWS
        and isinstance(w, torch.Tensor)
        and SWITCHES.gemv_dense
        and w.dtype == x.dtype == torch.bfloat16
        and w.is_contiguous()
    )


def _gemv(x: torch.Tensor, w: torch.Tensor | FP8Weight, groups: int) -> torch.Tensor:
    from ..kernels import ops

    return ops.gemv(x, *_operand(w), groups)


def _operand(w: torch.Tensor | FP8Weight) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """The GEMV ops' ``(weight, scale, block rows, block cols)`` arguments of ``w`` (dense: no scale)."""
    if isinstance(w, FP8Weight):
        return w.data, w.scale, w.block[0], w.block[1]
    return w, None, 0, 0


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
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
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
