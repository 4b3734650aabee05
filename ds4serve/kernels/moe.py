"""Fused MoE for a few tokens (decode, small verify blocks): selected experts read in place.

Tokens ``x [N, D]`` each go through their own ``k`` routed experts plus the shared expert, which
is one more slot (``S = k + 1`` slots a token). Three launches a call, no host synchronisation,
static shapes (CUDA-graph safe):

1. gate-up: one program per (token, slot) pair and block of intermediate rows reads the w1 and w3
   rows together and writes ``h = silu(clamp(w1 x, max=L)) * clamp(w3 x, -L, L)`` in fp32
   (times 2^64 for MXFP4 experts, see :func:`e2m1`);
2. down: one program per pair and block of output rows writes the fp32 partial
   ``weight * w2 h`` (the shared slot's weight is 1) to ``[N, S, D]``;
3. a sum over the slots in a fixed order (deterministic), cast to ``x.dtype``.

A program picks its expert's base pointers from its slot, so the shared expert rides in the same
launches. When its format differs from the routed experts' (MXFP4 routed, FP8 shared), the kernels
hold both paths and a program branches on its slot (one tile shape for both, the routed format's).

Expert weights are read where they lie in the stacked ``[E, out, in]`` tensors, as bf16/fp32,
FP8 e4m3 with fp32 block scales ``[E, out/b0, in/b1]``, or MXFP4 (two e2m1 codes a byte, low nibble
first, uint8 e8m0 exponents ``[E, out, in/32]``), and dequantised in registers. The tile shapes
come from :data:`CONFIGS`, one entry per format (``bench/sweep_moe.py`` measures them).
:func:`moe_ref` is the torch reference (it gathers dense copies of the selected experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import triton
import triton.language as tl

from ..quant import FP4Weight, FP8Weight, Weight
from . import pdl
from .tl_common import (
    DENSE,
    FP4,
    FP8,
    X_SCALE,
    accumulate,
    activations,
    rows_dot,
    scale_row,
    step_scales,
    weight_tile,
)


@dataclass(frozen=True)
class Tile:
    """One launch's tiling: a program reads ``rows`` weight rows, ``block_k`` inputs a loop step.

    Both are lowered to powers of two dividing the matrix (FP8 rows also the scale block), so no
    load is masked. ``stages`` is the loop's ``tl.range(num_stages=...)``: Triton 3.6 pipelines a
    loop without ``tl.dot`` (these are CUDA-core products) with ``cp.async`` only when the stage count
    is given on the loop, as the GEMV's (:mod:`ds4serve.kernels.gemv`) are; at 1 a program issues one
    step's loads at a time, and the bytes in flight come from the tile and the programs per SM; the
    tables keep 1 (more stages were slower: docs/KERNELS.md).
    """

    rows: int
    block_k: int
    warps: int = 4
    stages: int = 1


@dataclass(frozen=True)
class MoEConfig:
    gate_up: Tile
    down: Tile


# (token, expert) pairs up to which the model runs the fused kernels: decode and every verify block (up to 17 rows:
# 16 drafts, top-6 routing). A captured verify block runs as one compiled region, where quantized experts cannot
# take the grouped kernels and the other paths read group ends on the host, which a capture refuses.
MAX_PAIRS = 128

# Per format (ExpertStack.format): the best of bench/sweep_moe.py; fp32 (tests, tiny models) is not swept.
CONFIGS: dict[str, MoEConfig] = {
    "bf16": MoEConfig(Tile(16, 512), Tile(16, 512)),
    "fp32": MoEConfig(Tile(16, 256), Tile(16, 256)),
    "fp8": MoEConfig(Tile(32, 512), Tile(64, 256)),
    "fp4": MoEConfig(Tile(8, 1024), Tile(16, 2048)),
}


@triton.jit
def _gate_up_rows(
    x,
    w1,
    w3,
    s1,
    s3,
    row0,
    n_in,
    row_len,
    s_cols,
    limit,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``h`` of one expert's intermediate rows ``[row0, row0 + BLOCK_R)`` (MXFP4: times 2^64)."""
    s1 = scale_row(s1, row0, s_cols, QUANT, SB_R)
    s3 = scale_row(s3, row0, s_cols, QUANT, SB_R)
    rows = row0 + tl.arange(0, BLOCK_R)
    acc1 = tl.zeros([BLOCK_R, BLOCK_K // VEC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_R, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in tl.range(0, n_in, BLOCK_K, num_stages=STAGES):
        xv = activations(x, rows, k0, QUANT, BLOCK_K, X_SCALE)
        acc1 = accumulate(
            acc1,
            weight_tile(w1, rows, k0, row_len, QUANT, BLOCK_K),
            step_scales(s1, rows, k0, s_cols, QUANT, SB_C, VEC, BLOCK_K),
            xv,
            QUANT,
            VEC,
            BLOCK_K,
        )
        acc3 = accumulate(
            acc3,
            weight_tile(w3, rows, k0, row_len, QUANT, BLOCK_K),
            step_scales(s3, rows, k0, s_cols, QUANT, SB_C, VEC, BLOCK_K),
            xv,
            QUANT,
            VEC,
            BLOCK_K,
        )
    g = tl.sum(acc1, axis=1)
    u = tl.sum(acc3, axis=1)
    if limit > 0:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if QUANT == 2:
        h *= X_SCALE  # the MXFP4 down projection reads h scaled
    return h


@triton.jit
def _pair_program(top_k, n_slots, BLOCK_R: tl.constexpr):
    # This program's (token, slot) pair, the routing entry its slot reads (the shared slot top_k reads
    # the last routed one, unused) and its first row.
    pair = tl.program_id(0)
    token = pair // n_slots
    slot = pair % n_slots
    return pair, token, slot, token * top_k + tl.minimum(slot, top_k - 1), tl.program_id(1) * BLOCK_R


@triton.jit
def _gate_up_kernel(
    x_ptr,
    idx_ptr,
    h_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    w_stride,
    s_stride,
    row_len,
    s_cols,
    sw1_ptr,
    sw3_ptr,
    ss1_ptr,
    ss3_ptr,
    srow_len,
    ss_cols,
    n_in,
    n_inter,
    top_k,
    n_slots,
    limit,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    SQUANT: tl.constexpr,
    SSB_R: tl.constexpr,
    SSB_C: tl.constexpr,
    SVEC: tl.constexpr,
    MIXED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (token, slot) pair and block of intermediate rows; slot ``top_k`` is the
    shared expert (the S-prefixed parameters), in the routed format unless ``MIXED``."""
    pdl.start(PDL)
    pair, token, slot, choice, row0 = _pair_program(top_k, n_slots, BLOCK_R)
    x = x_ptr + token * n_in
    e = tl.load(idx_ptr + choice).to(tl.int64)
    if MIXED:
        if slot < top_k:
            h = _gate_up_rows(
                x,
                w1_ptr + e * w_stride,
                w3_ptr + e * w_stride,
                s1_ptr + e * s_stride,
                s3_ptr + e * s_stride,
                row0,
                n_in,
                row_len,
                s_cols,
                limit,
                QUANT,
                SB_R,
                SB_C,
                VEC,
                BLOCK_R,
                BLOCK_K,
                STAGES,
            )
        else:
            h = _gate_up_rows(
                x,
                sw1_ptr,
                sw3_ptr,
                ss1_ptr,
                ss3_ptr,
                row0,
                n_in,
                srow_len,
                ss_cols,
                limit,
                SQUANT,
                SSB_R,
                SSB_C,
                SVEC,
                BLOCK_R,
                BLOCK_K,
                STAGES,
            )
    else:
        shared = slot >= top_k
        h = _gate_up_rows(
            x,
            tl.where(shared, sw1_ptr, w1_ptr + e * w_stride),
            tl.where(shared, sw3_ptr, w3_ptr + e * w_stride),
            tl.where(shared, ss1_ptr, s1_ptr + e * s_stride),
            tl.where(shared, ss3_ptr, s3_ptr + e * s_stride),
            row0,
            n_in,
            row_len,
            s_cols,
            limit,
            QUANT,
            SB_R,
            SB_C,
            VEC,
            BLOCK_R,
            BLOCK_K,
            STAGES,
        )
    tl.store(h_ptr + pair * n_inter + row0 + tl.arange(0, BLOCK_R), h)


@triton.jit
def _down_kernel(
    h_ptr,
    idx_ptr,
    wt_ptr,
    part_ptr,
    w2_ptr,
    s2_ptr,
    w_stride,
    s_stride,
    row_len,
    s_cols,
    sw2_ptr,
    ss2_ptr,
    srow_len,
    ss_cols,
    n_out,
    n_inter,
    top_k,
    n_slots,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    SQUANT: tl.constexpr,
    SSB_R: tl.constexpr,
    SSB_C: tl.constexpr,
    SVEC: tl.constexpr,
    MIXED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per pair and block of output rows: the fp32 partial ``weight * w2 h``."""
    pdl.start(PDL)
    pair, token, slot, choice, row0 = _pair_program(top_k, n_slots, BLOCK_R)
    h = h_ptr + pair * n_inter
    e = tl.load(idx_ptr + choice).to(tl.int64)
    weight = tl.load(wt_ptr + choice).to(tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_K // VEC], dtype=tl.float32)
    if MIXED:
        if slot < top_k:
            y = rows_dot(
                h,
                w2_ptr + e * w_stride,
                s2_ptr + e * s_stride,
                row0,
                0,
                n_inter,
                row_len,
                s_cols,
                acc,
                QUANT,
                SB_R,
                SB_C,
                VEC,
                BLOCK_R,
                BLOCK_K,
                STAGES,
            )
        else:
            y = rows_dot(
                h,
                sw2_ptr,
                ss2_ptr,
                row0,
                0,
                n_inter,
                srow_len,
                ss_cols,
                tl.zeros([BLOCK_R, BLOCK_K // SVEC], dtype=tl.float32),
                SQUANT,
                SSB_R,
                SSB_C,
                SVEC,
                BLOCK_R,
                BLOCK_K,
                STAGES,
            )
    else:
        shared = slot >= top_k
        y = rows_dot(
            h,
            tl.where(shared, sw2_ptr, w2_ptr + e * w_stride),
            tl.where(shared, ss2_ptr, s2_ptr + e * s_stride),
            row0,
            0,
            n_inter,
            row_len,
            s_cols,
            acc,
            QUANT,
            SB_R,
            SB_C,
            VEC,
            BLOCK_R,
            BLOCK_K,
            STAGES,
        )
    y *= tl.where(slot < top_k, weight, 1.0)
    tl.store(part_ptr + pair * n_out + row0 + tl.arange(0, BLOCK_R), y)


@triton.jit
def sum_slots_kernel(part_ptr, out_ptr, n_out, n_slots, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_out
    part = part_ptr + token * n_slots * n_out + cols
    acc = tl.load(part, mask=m, other=0.0)
    for j in range(1, n_slots):
        acc += tl.load(part + j * n_out, mask=m, other=0.0)
    tl.store(out_ptr + token * n_out + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def sum_slots(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The fp32 slot terms ``part [N, S, D]`` summed over the slots in order, in ``like``'s dtype: ``[N, D]``."""
    N, S, D = part.shape
    out = torch.empty(N, D, device=part.device, dtype=like.dtype)
    sum_slots_kernel[(triton.cdiv(D, 1024), N)](part, out, D, S, BLOCK=1024, num_warps=4, **pdl.launch(like))
    return out


class ExpertStack:
    """The kernel's view of one expert matrix, stacked ``[E, out, in]`` or single ``[out, in]`` (the
    shared expert): dense, FP8 (``scale`` fp32 blocks of ``block``) or MXFP4 (int8 / uint8 packed
    data, uint8 exponents)."""

    def __init__(
        self, data: torch.Tensor, scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)
    ):
        if data.dim() == 2:
            data = data.unsqueeze(0)
            scale = None if scale is None else scale.unsqueeze(0)
        if data.stride(2) != 1 or data.stride(1) != data.shape[2]:
            raise ValueError("ExpertStack: each expert's rows must be contiguous")
        self.quant = DENSE if scale is None else (FP4 if data.dtype in (torch.int8, torch.uint8) else FP8)
        self.data = data.view(torch.uint8) if self.quant == FP4 else data
        self.scale = scale.contiguous() if scale is not None else data  # an unused pointer when dense
        self.block = tuple(block) if self.quant == FP8 else (1, 32) if self.quant == FP4 else (1, 1)
        self.out = data.shape[1]
        self.inp = data.shape[2] * (2 if self.quant == FP4 else 1)
        # inputs a thread sums in registers: a 16-byte vector (MXFP4: one scale group)
        self.vec = 32 if self.quant == FP4 else 16 // data.element_size()
        self.row_len = data.shape[2]  # elements (MXFP4: bytes) of a row
        dense = self.quant == DENSE
        self.s_stride, self.s_cols = (0, 0) if dense else (self.scale.stride(0), self.scale.shape[2])

    @classmethod
    def of(cls, w: Weight) -> "ExpertStack":
        """The stack of a model's expert weight (dense bf16 / fp32, :class:`~ds4serve.quant.FP8Weight` or
        :class:`~ds4serve.quant.FP4Weight`); raises ValueError for dense weights of another dtype."""
        if isinstance(w, FP8Weight):
            return cls(w.data, w.scale, tuple(w.block))
        if isinstance(w, FP4Weight):
            return cls(w.data, w.scale)
        if w.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"expert tiles: dense experts must be bf16 or fp32, not {w.dtype}")
        return cls(w)

    @property
    def format(self) -> str:
        """The key of this stack's tiles in :data:`CONFIGS`."""
        if self.quant != DENSE:
            return "fp8" if self.quant == FP8 else "fp4"
        return "fp32" if self.data.dtype == torch.float32 else "bf16"

    def same_format(self, other: "ExpertStack") -> bool:
        """Whether one code path reads both (same dtypes and scale blocks)."""
        return (self.quant, self.data.dtype, self.scale.dtype, self.block) == (
            other.quant,
            other.data.dtype,
            other.scale.dtype,
            other.block,
        )


Experts = tuple[ExpertStack, ExpertStack, ExpertStack]  # (w1, w3, w2)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides ``n`` and is at most ``cap``."""
    p = 1
    while 2 * p <= cap and n % (2 * p) == 0:
        p *= 2
    return p


def _shape(tile: Tile, stacks: tuple[ExpertStack, ExpertStack]) -> tuple[int, int]:
    """(rows, block_k) of ``tile`` for a launch reading both stacks: powers of two dividing their
    matrices; FP8 rows also dividing the scale block's rows, FP8 steps nested with the scale block's
    columns; whole vectors a step."""
    vec = max(s.vec for s in stacks)
    rows, block_k = tile.rows, max(tile.block_k, vec)
    for s in stacks:
        (sb_r, sb_c), inp = s.block, s.inp
        rows = _pow2_divisor(math.gcd(s.out, sb_r) if s.quant == FP8 else s.out, rows)
        block_k = _pow2_divisor(math.gcd(inp, sb_c) if s.quant == FP8 and sb_c & (sb_c - 1) else inp, block_k)
    if block_k < vec:
        raise ValueError(
            f"moe_fused: the inputs of {[(s.inp, s.block) for s in stacks]} (FP8 blocks) do not "
            f"split into {vec}-input vectors"
        )
    return rows, block_k


def _config(stack: ExpertStack, configs: Mapping[str, MoEConfig] | None) -> MoEConfig:
    return (configs or {}).get(stack.format) or CONFIGS[stack.format]


def _formats(a: ExpertStack, b: ExpertStack) -> dict:
    """The kernels' compile-time parameters for routed stack ``a`` and shared stack ``b``."""
    return dict(
        QUANT=a.quant,
        SB_R=a.block[0],
        SB_C=a.block[1],
        VEC=a.vec,
        SQUANT=b.quant,
        SSB_R=b.block[0],
        SSB_C=b.block[1],
        SVEC=b.vec,
        MIXED=not a.same_format(b),
    )


def moe_fused(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: ExpertStack,
    w3: ExpertStack,
    w2: ExpertStack,
    limit: float,
    shared: Experts | None = None,
    configs: Mapping[str, MoEConfig] | None = None,
    summed: bool = True,
) -> torch.Tensor:
    """``sum_j weights[:, j] * w2[idx[:, j]] swiglu(...)`` (plus the ``shared`` expert, weight 1)
    for tokens ``x [N, D]`` routed to ``idx [N, k]``. Tiles: the routed format's entry of ``configs``
    or else :data:`CONFIGS`. ``summed=False`` returns the fp32 terms ``[N, slots, D]`` (the shared
    expert last) instead, for a consumer that sums them itself (:func:`ds4serve.model.hyper.sum_terms` is
    that sum)."""
    N, D = x.shape
    k = idx.shape[1]
    sw1, sw3, sw2 = shared or (w1, w3, w2)
    if (sw1.out, sw1.inp, sw2.out, sw2.inp) != (w1.out, w1.inp, w2.out, w2.inp):
        raise ValueError("moe_fused: the shared expert's shapes differ from the routed experts'")
    slots = k + (shared is not None)
    x = x.contiguous()
    idx = idx.contiguous()
    weights = weights.contiguous()
    h = torch.empty(N, slots, w1.out, device=x.device, dtype=torch.float32)
    part = torch.empty(N, slots, D, device=x.device, dtype=torch.float32)
    config = _config(w1, configs)
    rows, block_k = _shape(config.gate_up, (w1, sw1))
    _gate_up_kernel[(N * slots, w1.out // rows)](
        x,
        idx,
        h,
        w1.data,
        w3.data,
        w1.scale,
        w3.scale,
        w1.data.stride(0),
        w1.s_stride,
        w1.row_len,
        w1.s_cols,
        sw1.data,
        sw3.data,
        sw1.scale,
        sw3.scale,
        sw1.row_len,
        sw1.s_cols,
        D,
        w1.out,
        k,
        slots,
        float(limit),
        **_formats(w1, sw1),
        BLOCK_R=rows,
        BLOCK_K=block_k,
        STAGES=config.gate_up.stages,
        num_warps=config.gate_up.warps,
        num_stages=config.gate_up.stages,
        **pdl.launch(x),
    )
    rows, block_k = _shape(config.down, (w2, sw2))
    _down_kernel[(N * slots, D // rows)](
        h,
        idx,
        weights,
        part,
        w2.data,
        w2.scale,
        w2.data.stride(0),
        w2.s_stride,
        w2.row_len,
        w2.s_cols,
        sw2.data,
        sw2.scale,
        sw2.row_len,
        sw2.s_cols,
        D,
        w2.inp,
        k,
        slots,
        **_formats(w2, sw2),
        BLOCK_R=rows,
        BLOCK_K=block_k,
        STAGES=config.down.stages,
        num_warps=config.down.warps,
        num_stages=config.down.stages,
        **pdl.launch(x),
    )
    return part if not summed else sum_slots(part, x)


def moe_ref(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Torch reference on dense ``[E, out, in]`` stacks (and a dense ``[out, in]`` shared expert, weight 1),
    computed in fp32."""
    if shared is not None:
        E = w1.shape[0]
        w1, w3, w2 = (torch.cat([w.float(), s.float().unsqueeze(0)]) for w, s in zip((w1, w3, w2), shared))
        idx = torch.cat([idx, torch.full_like(idx[:, :1], E)], dim=1)
        weights = torch.cat([weights.float(), torch.ones_like(weights[:, :1], dtype=torch.float32)], dim=1)
    xf = x.float()
    g = torch.einsum("nd,nkid->nki", xf, w1[idx].float())
    u = torch.einsum("nd,nkid->nki", xf, w3[idx].float())
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    h = torch.nn.functional.silu(g) * u
    y = torch.einsum("nki,nkoi->nko", h, w2[idx].float())
    return (y * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)
