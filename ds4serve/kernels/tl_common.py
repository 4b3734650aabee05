"""Triton helpers shared by the fused MoE (:mod:`.moe`), the GEMV (:mod:`.gemv`), the grouped experts
(:mod:`.grouped_experts`) and the router (:mod:`.router`): weight formats, MXFP4 decoding, the CUDA-core
vector product and bf16 rounding on the bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

DENSE, FP8, FP4 = 0, 1, 2  # a weight's format, the kernels' QUANT constant
X_SCALE = tl.constexpr(2.0**64)  # MXFP4: the activations are scaled by this (see e2m1)


@triton.jit
def round_bf16(v, BF16: tl.constexpr):
    """fp32 ``v`` rounded to bf16 (to nearest even, on the bits), still as fp32; ``v`` itself for fp32."""
    if BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v


@triton.jit
def e2m1(b):
    """uint8 bytes of two e2m1 codes (low nibble first) -> fp32 values times 2^-126, exactly.

    A code's sign goes to bit 31 and its exponent and mantissa bits to bits 24..22 (one integer
    multiply places both copies), which reads as the e2m1 value times 2^-126: 0.5 as an fp32
    subnormal, the others as zero or normals. No exp2 and no select. The products with activations
    scaled by 2^64 are normal numbers again; the group scale takes the remaining 2^62.
    """
    b32 = b.to(tl.int32)
    lo = ((b32 & 0xF) * 0x10400000) & -2118123520  # mask 0x81C00000
    hi = ((b32 & 0xF0) * 0x01040000) & -2118123520
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def group_scale(e):
    """uint8 e8m0 exponents -> fp32 ``2^(e - 127) * 2^62`` from its bits (exponents up to 192).

    With the activations' 2^64 (magnitudes below 2^64) every factor is a power of two applied
    exactly, so the MXFP4 dot products are the exact dequantised ones up to fp32 rounding.
    """
    return ((e.to(tl.int32) + 62) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scales(s_ptr, k0, SB_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """The block scales of inputs ``[k0, k0 + BLOCK_K)`` in this program's scale row: a scalar, or
    ``[1, BLOCK_K]`` picked from one scalar per block (a gather would change the layout)."""
    first = k0 // SB_C
    if BLOCK_K <= SB_C:
        return tl.load(s_ptr + first)
    else:
        block = ((k0 + tl.arange(0, BLOCK_K)) // SB_C)[None, :]
        s = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        for c in tl.static_range(BLOCK_K // SB_C):
            s = tl.where(block == first + c, tl.load(s_ptr + first + c), s)
        return s


@triton.jit
def activations(x_ptr, rows, k0, QUANT: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr):
    """fp32 activations of inputs ``[k0, k0 + BLOCK_K)``, loaded as a tile of the weight tile's shape.

    The tile repeats one row (row stride 0): Triton gives the loads of one shape in a loop the same
    register layout, so activations and weights meet with no data moved between threads, and the
    repeated rows compile to one load. MXFP4: ``[R, BLOCK_K / 2, 2]``, the (even, odd) inputs of
    each weight byte read as one word, times ``SCALE``.
    """
    zero = (rows * 0)[:, None]
    if QUANT == 2:
        cols = (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :]
        ty: tl.constexpr = x_ptr.dtype.element_ty
        if ty == tl.float32:
            w = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + zero + cols)
            even = w.to(tl.int32).to(tl.float32, bitcast=True)
            odd = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        else:
            w = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + zero + cols)
            if ty == tl.bfloat16:
                even = (w << 16).to(tl.float32, bitcast=True)
                odd = (w & -65536).to(tl.float32, bitcast=True)
            else:
                even = w.to(tl.int16).to(ty, bitcast=True).to(tl.float32)
                odd = (w >> 16).to(tl.int16).to(ty, bitcast=True).to(tl.float32)
        if SCALE != 1.0:
            even *= SCALE
            odd *= SCALE
        return tl.join(even, odd)
    else:
        return tl.load(x_ptr + zero + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(tl.float32)


@triton.jit
def weight_tile(w_ptr, rows, k0, row_len, QUANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step's weights of the rows ``rows`` and inputs ``[k0, k0 + BLOCK_K)`` as stored (MXFP4: their bytes),
    for :func:`accumulate`."""
    if QUANT == 2:
        return tl.load(w_ptr + rows[:, None] * row_len + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
    else:
        return tl.load(w_ptr + rows[:, None] * row_len + (k0 + tl.arange(0, BLOCK_K))[None, :])


@triton.jit
def scale_row(s_ptr, row0, s_cols, QUANT: tl.constexpr, SB_R: tl.constexpr):
    """FP8: the scale row of a program's rows from ``row0`` (they lie in one, the launcher makes sure);
    ``s_ptr`` itself for the other formats."""
    if QUANT == 1:
        return s_ptr + (row0 // SB_R) * s_cols
    else:
        return s_ptr


@triton.jit
def step_scales(
    s_ptr, rows, k0, s_cols, QUANT: tl.constexpr, SB_C: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The scales of one step's weights (inputs ``[k0, k0 + BLOCK_K)``), for :func:`accumulate`: FP8 the block
    scales of the program's scale row ``s_ptr`` (:func:`scale_row`), MXFP4 the exponent of each row's scale
    groups, dense weights none (1)."""
    if QUANT == 2:
        return tl.load(s_ptr + rows[:, None] * s_cols + (k0 // VEC + tl.arange(0, BLOCK_K // VEC))[None, :])
    elif QUANT == 1:
        return fp8_scales(s_ptr, k0, SB_C, BLOCK_K)
    else:
        return 1.0


@triton.jit
def decoded(w, QUANT: tl.constexpr):
    """A step's weights (:func:`weight_tile`) as fp32 values for :func:`products`: MXFP4 ``[R, BLOCK_K / 2, 2]``
    (the codes of each byte, times 2^-126, :func:`e2m1`), the others cast."""
    if QUANT == 2:
        lo, hi = e2m1(w)
        v = tl.join(lo, hi)
    else:
        v = w.to(tl.float32)
    return v


@triton.jit
def products(wd, scales, xv, QUANT: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[R, BLOCK_K / VEC]``: one step's products of the :func:`decoded` weights ``wd`` and their ``scales``
    (:func:`step_scales`) with the activations from :func:`activations`, summed over each thread's 16-byte
    vector (``VEC`` inputs, for MXFP4 the 32 inputs of a scale group): a chain of FMAs in the registers that
    hold the vector. FP8 block scales multiply the activations (a program's rows lie in one scale row), not
    every weight."""
    R: tl.constexpr = wd.shape[0]
    if QUANT == 2:
        part = tl.sum(tl.reshape(wd * xv, [R, BLOCK_K // VEC, VEC]), axis=2) * group_scale(scales)
    else:
        if QUANT == 1:
            xv = xv * scales
        part = tl.sum(tl.reshape(wd * xv, [R, BLOCK_K // VEC, VEC]), axis=2)
    return part


@triton.jit
def accumulate(acc, w, scales, xv, QUANT: tl.constexpr, VEC: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc [R, BLOCK_K / VEC]`` plus one step's :func:`products` of the weight tile ``w`` (:func:`weight_tile`)."""
    return acc + products(decoded(w, QUANT), scales, xv, QUANT, VEC, BLOCK_K)


@triton.jit
def rows_dot(
    h,
    w2,
    s2,
    row0,
    k_start,
    n_inter,
    row_len,
    s_cols,
    acc,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``w2 h`` of the rows ``[row0, row0 + BLOCK_R)`` of ``w2`` (rows of ``row_len`` elements), ``h`` one
    vector: ``acc`` (:func:`accumulate`'s: zeros, or the steps before ``k_start``) plus the steps over inputs
    ``[k_start, n_inter)``, summed per row. An expert's down projection, and a one-token GEMV's vector tiles
    (:mod:`ds4serve.kernels.gemv`, which may take its first step's weights before the PDL wait)."""
    s2 = scale_row(s2, row0, s_cols, QUANT, SB_R)
    rows = row0 + tl.arange(0, BLOCK_R)
    for k0 in tl.range(k_start, n_inter, BLOCK_K, num_stages=STAGES):
        hv = activations(h, rows, k0, QUANT, BLOCK_K, 1.0)
        acc = accumulate(
            acc,
            weight_tile(w2, rows, k0, row_len, QUANT, BLOCK_K),
            step_scales(s2, rows, k0, s_cols, QUANT, SB_C, VEC, BLOCK_K),
            hv,
            QUANT,
            VEC,
            BLOCK_K,
        )
    return tl.sum(acc, axis=1)
