"""Quantized weights to dense values in one pass, for the chunk forwards (prefill) that multiply
them as dense matrices.

The torch references (:func:`ds4serve.quant.dequant_fp4`, :func:`ds4serve.quant.dequant_fp8`) go
through int64 lookup indices, fp32 values and full-size fp32 scale tensors: for MXFP4 about 50 bytes
of memory traffic per weight, which made a 2048-token prefill chunk of the full-size Flash shape
(256 MXFP4 experts a layer) take seconds. Here a program reads a tile of codes and its scales once
and writes the dense tile: 2.5 bytes per MXFP4 weight to bf16, 3 per FP8 weight. Every value is a
code times a power of two, so the results equal the references exactly (in bf16 too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16
BLOCK_COLS = 256


@triton.jit
def _pow2(biased):
    """fp32 ``2^(biased - 127)`` built from its bits, for int32 ``biased`` in 0..254 (e8m0 exponents).
    Exact, where ``tl.exp2`` is the GPU's approximate ex2 (the interpreter's is exact)."""
    return tl.where(biased > 0, biased << 23, 1 << 22).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """An MXFP4 (e2m1) code to its value: 0, 0.5, 1, 1.5, 2, 3, 4, 6, and the same negated for bit 3."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * _pow2(e + 126))
    # the sign as a bit: a select of -v and v lost the sign of -0 on the GPU (the compiler's, not IEEE's)
    return (v.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_kernel(packed_ptr, scale_ptr, out_ptr, rows, half, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    j = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    mask = (r < rows) & (j < half)
    byte = tl.load(packed_ptr + r * half + j, mask=mask, other=0).to(tl.int32)
    exponent = tl.load(scale_ptr + r * (half // 16) + j // 16, mask=mask, other=127).to(tl.int32)
    factor = _pow2(exponent)
    out = out_ptr + r * (2 * half) + 2 * j
    tl.store(out, (_e2m1(byte & 15) * factor).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, (_e2m1(byte >> 4) * factor).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_kernel(
    w_ptr,
    scale_ptr,
    out_ptr,
    rows,
    cols,
    scale_cols,
    B0: tl.constexpr,
    B1: tl.constexpr,
    E8M0: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (r < rows) & (c < cols)
    x = tl.load(w_ptr + r * cols + c, mask=mask, other=0.0).to(tl.float32)
    # stacked matrices are one run of rows (whole row blocks each), their scale rows too
    s = tl.load(scale_ptr + (r // B0) * scale_cols + c // B1, mask=mask, other=1)
    if E8M0:
        s = _pow2(s.to(tl.int32))
    tl.store(out_ptr + r * cols + c, (x * s.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`ds4serve.quant.dequant_fp4`: ``[..., out, in/2]`` int8 codes with uint8 e8m0 scales
    ``[..., out, in/32]`` to ``[..., out, in]`` of ``dtype``."""
    half = packed.shape[-1]
    if half % 16 or tuple(scale.shape) != (*packed.shape[:-1], half // 16):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match codes {tuple(packed.shape)}")
    codes = packed.contiguous().view(torch.uint8)
    exponents = _raw_exponents(scale).contiguous()
    out = torch.empty(*packed.shape[:-1], 2 * half, dtype=dtype, device=packed.device)
    rows = codes.numel() // half
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(half, BLOCK_COLS // 2))
    _fp4_kernel[grid](codes, exponents, out, rows, half, BLOCK_R=BLOCK_ROWS, BLOCK_H=BLOCK_COLS // 2)
    return out


def dequant_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """:func:`ds4serve.quant.dequant_fp8`: e4m3 ``[..., out, in]`` times its block scales
    ``[..., ceil(out/b0), ceil(in/b1)]`` (fp32, or uint8 / float8_e8m0fnu exponents)."""
    out_dim, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], -(-out_dim // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} "
            f"with block {block}: expected {expected}"
        )
    if out_dim % block[0] and weight.dim() > 2:  # the flat row index would not find the scale row
        return torch.stack([dequant_fp8(w, s, block, dtype) for w, s in zip(weight, scale)])
    e8m0 = scale.dtype in (torch.uint8, torch.float8_e8m0fnu)
    scales = (_raw_exponents(scale) if e8m0 else scale.float()).contiguous()
    w = weight.contiguous()
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    rows = w.numel() // cols
    grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(cols, BLOCK_COLS))
    _fp8_kernel[grid](
        w,
        scales,
        out,
        rows,
        cols,
        expected[-1],
        B0=block[0],
        B1=block[1],
        E8M0=e8m0,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_C=BLOCK_COLS,
    )
    return out


def _raw_exponents(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
