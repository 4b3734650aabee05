"""Fused MoE for a few tokens (decode, small verify blocks): selected experts read in place.

Two launches per call, no host synchronisation, static shapes (CUDA-graph safe):

1. gate-up: one program per (token, slot) pair and block of intermediate rows computes
   ``h = silu(clamp(w1[e] x, max=L)) * clamp(w3[e] x, -L, L)`` in fp32;
2. down: one program per token and block of output rows accumulates ``sum_j weight_j * w2[e_j] h_j``
   over the token's slots, optionally adding into an existing output (routed + shared expert).

Expert weights are read where they lie in the stacked ``[E, out, in]`` tensors, as bf16/fp32,
FP8 e4m3 with fp32 block scales ``[E, out/b0, in/b1]``, or MXFP4 (two e2m1 codes a byte, low nibble
first, uint8 e8m0 exponents ``[E, out, in/32]``); they are dequantised in registers.
:func:`moe_ref` is the torch reference (it gathers dense copies of the selected experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .switches import SWITCHES

DENSE, FP8, FP4 = 0, 1, 2


@triton.jit
def _e2m1(code):
    """e2m1 code (int32, 0..15) -> fp32 value."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(code >= 8, -v, v)


@triton.jit
def _e2m1_twice(code):
    """2 x the e2m1 value of ``code`` (int32, 0..15) from integer arithmetic, exactly:
    magnitudes 0, 1, 2, 3, 4, 6, 8, 12 for the codes 0..7, negated for 8..15."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    v = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0)).to(tl.float32)
    return tl.where(code >= 8, -v, v)


@triton.jit
def _tile_dot(w_ptr, s_ptr, x_ptr, rows, rmask, d0, n_in, s_cols, acc,
              QUANT: tl.constexpr, SB_R: tl.constexpr, SB_C: tl.constexpr, BLOCK_D: tl.constexpr,
              INT_FP4: tl.constexpr = False):
    """``acc [R, BLOCK_D or BLOCK_D/2] += W[rows, d0:d0+BLOCK_D] * x[d0:...]`` elementwise (reduced later).

    FP8: the tile's rows lie in one scale row (checked by the caller), so the block scales multiply
    the activation slice, not every weight. MXFP4 with ``INT_FP4``: codes decoded from integer
    arithmetic and one ``exp2`` per 32-input scale group, broadcast over the group's 16 bytes (the
    same exact values as the per-element ``exp2`` decode).
    """
    if QUANT == 2 and INT_FP4:
        half: tl.constexpr = BLOCK_D // 2
        j = tl.arange(0, half)
        cols = d0 // 2 + j
        cmask = cols < n_in // 2
        m = rmask[:, None] & cmask[None, :]
        packed = tl.load(w_ptr + rows[:, None] * (n_in // 2) + cols[None, :], mask=m, other=0)
        byte = packed.to(tl.int32) & 0xFF
        groups: tl.constexpr = half // 16
        g = d0 // 32 + tl.arange(0, groups)
        gm = rmask[:, None] & (g < s_cols)[None, :]
        exps = tl.load(s_ptr + rows[:, None] * s_cols + g[None, :], mask=gm, other=127)
        group_scale = tl.exp2(exps.to(tl.float32) - 128.0)  # 0.5 x the scale: the codes are doubled
        scale = tl.reshape(tl.broadcast_to(group_scale[:, :, None], [group_scale.shape[0], groups, 16]),
                           [group_scale.shape[0], half])
        xe = tl.load(x_ptr + d0 + 2 * j, mask=cmask, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + d0 + 2 * j + 1, mask=cmask, other=0.0).to(tl.float32)
        acc += scale * (_e2m1_twice(byte & 15) * xe[None, :] + _e2m1_twice(byte >> 4) * xo[None, :])
    elif QUANT == 2:
        half: tl.constexpr = BLOCK_D // 2
        j = tl.arange(0, half)
        cols = d0 // 2 + j
        cmask = cols < n_in // 2
        m = rmask[:, None] & cmask[None, :]
        packed = tl.load(w_ptr + rows[:, None] * (n_in // 2) + cols[None, :], mask=m, other=0)
        byte = packed.to(tl.int32) & 0xFF
        exps = tl.load(s_ptr + rows[:, None] * s_cols + ((d0 + 2 * j) // 32)[None, :], mask=m, other=127)
        scale = tl.exp2(exps.to(tl.float32) - 127.0)
        xe = tl.load(x_ptr + d0 + 2 * j, mask=cmask, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + d0 + 2 * j + 1, mask=cmask, other=0.0).to(tl.float32)
        acc += scale * (_e2m1(byte & 15) * xe[None, :] + _e2m1(byte >> 4) * xo[None, :])
    else:
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < n_in
        m = rmask[:, None] & cmask[None, :]
        w = tl.load(w_ptr + rows[:, None] * n_in + cols[None, :], mask=m, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if QUANT == 1:
            xv = xv * tl.load(s_ptr + (tl.min(rows, axis=0) // SB_R) * s_cols + cols // SB_C, mask=cmask, other=0.0)
        acc += w * xv[None, :]
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, idx_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, n_in, n_inter, top_k, limit,
                    w_expert_stride, s_expert_stride, s_cols,
                    QUANT: tl.constexpr, SB_R: tl.constexpr, SB_C: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, INT_FP4: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // top_k
    e = tl.load(idx_ptr + pair).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    rmask = rows < n_inter
    w1 = w1_ptr + e * w_expert_stride
    w3 = w3_ptr + e * w_expert_stride
    s1 = s1_ptr + e * s_expert_stride
    s3 = s3_ptr + e * s_expert_stride
    x = x_ptr + token * n_in
    width: tl.constexpr = BLOCK_D // 2 if QUANT == 2 else BLOCK_D
    acc_g = tl.zeros([BLOCK_I, width], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, width], dtype=tl.float32)
    for d0 in range(0, n_in, BLOCK_D):
        acc_g = _tile_dot(w1, s1, x, rows, rmask, d0, n_in, s_cols, acc_g, QUANT, SB_R, SB_C, BLOCK_D, INT_FP4)
        acc_u = _tile_dot(w3, s3, x, rows, rmask, d0, n_in, s_cols, acc_u, QUANT, SB_R, SB_C, BLOCK_D, INT_FP4)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if limit > 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair * n_inter + rows, h, mask=rmask)


@triton.jit
def _down_kernel(h_ptr, idx_ptr, wt_ptr, w2_ptr, s2_ptr, out_ptr, n_out, n_inter, top_k,
                 w_expert_stride, s_expert_stride, s_cols,
                 QUANT: tl.constexpr, SB_R: tl.constexpr, SB_C: tl.constexpr, ACCUMULATE: tl.constexpr,
                 BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, INT_FP4: tl.constexpr):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    rmask = rows < n_out
    width: tl.constexpr = BLOCK_I // 2 if QUANT == 2 else BLOCK_I
    acc = tl.zeros([BLOCK_O, width], dtype=tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        e = tl.load(idx_ptr + pair).to(tl.int64)
        weight = tl.load(wt_ptr + pair).to(tl.float32)
        part = tl.zeros([BLOCK_O, width], dtype=tl.float32)
        for i0 in range(0, n_inter, BLOCK_I):
            part = _tile_dot(w2_ptr + e * w_expert_stride, s2_ptr + e * s_expert_stride, h_ptr + pair * n_inter,
                             rows, rmask, i0, n_inter, s_cols, part, QUANT, SB_R, SB_C, BLOCK_I, INT_FP4)
        acc += part * weight
    out = tl.sum(acc, axis=1)
    if ACCUMULATE:
        out += tl.load(out_ptr + token * n_out + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * n_out + rows, out.to(out_ptr.dtype.element_ty), mask=rmask)


def _pow2(n: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(max(n, 16)))


class ExpertStack:
    """The kernel's view of one stacked expert matrix ``[E, out, in]`` (dense, FP8 or MXFP4)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)):
        self.data = data
        self.quant = DENSE if scale is None else (FP4 if data.dtype in (torch.int8, torch.uint8) else FP8)
        self.scale = scale if scale is not None else data  # unused pointer when dense
        self.block = block if self.quant == FP8 else (1, 32)
        self.out = data.shape[1]
        self.inp = data.shape[2] * (2 if self.quant == FP4 else 1)

    def scale_dims(self) -> tuple[int, int]:
        """(expert stride, columns) of the scale tensor."""
        if self.quant == DENSE:
            return 0, 0
        return self.scale.stride(0), self.scale.shape[2]


def moe_fused(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: ExpertStack, w3: ExpertStack,
              w2: ExpertStack, limit: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out (+)= sum_j weights[:, j] * w2[idx[:, j]] swiglu(...)`` for ``x [N, D]``, ``idx [N, k]``.

    When ``out`` is given the result is added to it (in place) and it is returned.
    """
    N, D = x.shape
    k = idx.shape[1]
    inter = w1.out
    x = x.contiguous()
    idx = idx.contiguous()
    weights = weights.contiguous().float()
    h = torch.empty(N * k, inter, device=x.device, dtype=torch.float32)
    wide = SWITCHES.moe_wide and w1.quant != DENSE
    widen = (1 if not wide else 2 if w1.quant == FP8 else 4)  # bytes per tile as for bf16
    block_d = _pow2(D, 256 * widen)
    block_i = _pow2(inter, 16)
    block_o = _pow2(D, 16)
    if w1.quant == FP8 and (w1.block[0] % block_i or w2.block[0] % block_o):
        raise ValueError(f"moe_fused: FP8 scale blocks of {w1.block[0]} rows do not hold {block_i}-row tiles")
    ss, sc = w1.scale_dims()
    _gate_up_kernel[(N * k, triton.cdiv(inter, block_i))](
        x, idx, w1.data, w3.data, w1.scale, w3.scale, h, D, inter, k, float(limit),
        w1.data.stride(0), ss, sc,
        QUANT=w1.quant, SB_R=w1.block[0], SB_C=w1.block[1], BLOCK_I=block_i, BLOCK_D=block_d, INT_FP4=wide,
        num_warps=4)
    accumulate = out is not None
    if out is None:
        out = torch.empty(N, D, device=x.device, dtype=x.dtype)
    wide = SWITCHES.moe_wide and w2.quant != DENSE
    block_k = _pow2(inter, 256 * (1 if not wide else 2 if w2.quant == FP8 else 4))
    ss, sc = w2.scale_dims()
    _down_kernel[(N, triton.cdiv(D, block_o))](
        h, idx, weights, w2.data, w2.scale, out, D, inter, k, w2.data.stride(0), ss, sc,
        QUANT=w2.quant, SB_R=w2.block[0], SB_C=w2.block[1], ACCUMULATE=accumulate,
        BLOCK_O=block_o, BLOCK_I=block_k, INT_FP4=wide, num_warps=4)
    return out


def moe_ref(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
            w2: torch.Tensor, limit: float) -> torch.Tensor:
    """Torch reference on dense ``[E, out, in]`` stacks, computed in fp32."""
    xf = x.float()
    g = torch.einsum("nd,nkid->nki", xf, w1[idx].float())
    u = torch.einsum("nd,nkid->nki", xf, w3[idx].float())
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    h = torch.nn.functional.silu(g) * u
    y = torch.einsum("nki,nkoi->nko", h, w2[idx].float())
    return (y * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
