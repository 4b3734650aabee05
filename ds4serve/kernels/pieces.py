"""Activations as sums of e4m3 numbers, for FP8 x FP8 tensor-core products (Hopper's FP8 MMA).

A row's inputs go in spans of :data:`PIECE_SPAN`; each span gets a power of two ``S`` that puts its largest
magnitude in [64, 128), and each value ``x`` becomes ``count`` e4m3 numbers with ``x S = q0 + q1/16 +
q2/256 + ...``: every piece the rounding the ones before it left, times 16. A piece holds 4 significant
bits and the last one's step is ``2^-(4 count + 5)`` (in units of ``S``), so 3 pieces hold every bf16 value
(8 bits) down to 2^-16 of the span's largest exactly and 6 an fp32 one (24 bits) down to 2^-12; smaller
values are off by less than that step. The products with e4m3 weights are exact, and the MMA's partial for
column ``j`` is scaled by ``16^-j / S``. The GEMV (:mod:`ds4serve.kernels.gemv`) and the fused
MoE's down projection (:mod:`ds4serve.kernels.moe`) read them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

PIECE_SPAN = 128  # inputs sharing one power-of-two activation scale


@triton.jit
def pow2(e):
    """``2^e`` for integer ``e`` in fp32's normal range, exactly (from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(r):
    """``r`` (|r| < 448) rounded to the nearest e4m3 value, in fp32 arithmetic: 4 significant bits from 2^-6 up
    (Veltkamp's split at 20 bits), multiples of 2^-9 below. Exact only without FP contraction (the launch
    passes ``enable_fp_fusion=False``); the e4m3 cast of its result is then exact on any backend (Triton's
    interpreter rounds some fp32 -> e4m3 casts otherwise)."""
    c = r * 1048577.0
    high = c - (c - r)
    low = (r + 24576.0) - 24576.0
    return tl.where(tl.abs(r) >= 0.015625, high, low)


@triton.jit
def _pieces_kernel(x_ptr, p_ptr, s_ptr, n_in, x_stride, n_spans, SPAN: tl.constexpr, PIECES: tl.constexpr,
                   PDL: tl.constexpr):
    # One program per span of SPAN inputs and token: S = 2^(6 - floor(log2 max |x|)), then e4m3 pieces of x S,
    # each the rounding left by the ones before times 16; S^-1 per span.
    pdl.start(PDL)
    span = tl.program_id(0)
    token = tl.program_id(1)
    k = span * SPAN + tl.arange(0, SPAN)
    v = tl.load(x_ptr + token * x_stride + k, mask=k < n_in, other=0.0).to(tl.float32)
    m = tl.max(tl.abs(v), axis=0)
    e = tl.maximum(((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100)  # floor(log2 m); -100 for 0
    r = v * pow2(6 - e)
    for j in tl.static_range(PIECES):
        q = _round_e4m3(r)
        tl.store(p_ptr + (token * PIECES + j) * n_in + k, q.to(tl.float8e4nv), mask=k < n_in)
        r = (r - q) * 16.0
    tl.store(s_ptr + token * n_spans + span, pow2(e - 6))


def activation_pieces(x2: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [N, K]`` as ``(pieces [N * count, K] e4m3, s_inv [N, ceil(K / PIECE_SPAN)] fp32)``: row ``t count + j``
    holds piece ``j`` of row ``t``, and ``x = s_inv * sum_j pieces_j 16^-j`` per span (one launch)."""
    n_tokens, n_in = x2.shape
    n_spans = triton.cdiv(n_in, PIECE_SPAN)
    pieces = torch.empty(n_tokens * count, n_in, device=x2.device, dtype=torch.float8_e4m3fn)
    s_inv = torch.empty(n_tokens, n_spans, device=x2.device, dtype=torch.float32)
    _pieces_kernel[(n_spans, n_tokens)](x2, pieces, s_inv, n_in, x2.stride(0), n_spans, SPAN=PIECE_SPAN,
                                        PIECES=count, num_warps=4, enable_fp_fusion=False, **pdl.launch(x2))
    return pieces, s_inv
