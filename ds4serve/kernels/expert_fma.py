"""MXFP4 experts of a batched decode step on CUDA cores: a step of an expert's weights decoded once for ``M`` of
the (token, slot) pairs routed to it, each pair's result independent of the other pairs.

:func:`ds4serve.kernels.expert_tiles.expert_tiles` sends MXFP4 routed experts here, with its contract and
outputs: ``h [R * (k + 1), N]`` in the activations' dtype (rounded where the torch code rounds; here times 2^64
where MXFP4 weights read it), then the fp32 slot terms ``[R, k + 1, D]``, the shared expert (one more slot, in any
format) last. The tensor-core tiles there spend their time decoding codes into the operand layout; here a program
decodes once and takes each pair's products as :mod:`.moe`'s per-pair programs do.

A plan launch sorts the pairs by expert (then row-major) and cuts each expert's run into tiles of ``M``; the
gate-up and the down launches run one program per (tile, block of ``BLOCK_R`` weight rows), the shared
expert's tiles (``M`` tokens each) after the routed ones. A program's products for each of its ``M`` places
are the same code (:func:`~.tl_common.products`, a CUDA-core FMA chain a pair, a place's own accumulator), so a
pair's bits depend on its token and expert alone, never on its tile or its place there; a routed tile holding one
pair (an expert's last, where its run is odd) takes that place's products alone. The MXFP4 products take their
activations times 2^64 (:func:`~.tl_common.e2m1`): the tokens are scaled once before the launches and the gate-up
launch stores those rows of ``h`` scaled, exactly (a power of two), rather than every program scaling each
activation it reads. The grid is fixed by the shapes (:func:`routed_tiles`); programs past the routing's tiles
exit. No host read: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant import Weight
from . import pdl
from .grouped_experts import gated_rounded
from .moe import ExpertStack, Tile, _formats, _shape, sum_slots
from .tl_common import (
    FP4,
    X_SCALE,
    activations,
    decoded,
    products,
    round_bf16,
    scale_row,
    step_scales,
    weight_tile,
)


@dataclass(frozen=True)
class FmaConfig:
    """Pairs a program takes (``pairs``) and the gate-up and down tiles (:class:`~.moe.Tile`)."""

    pairs: int
    gate_up: Tile
    down: Tile


# One for every batch size (a pair's bits must not depend on it): the best of bench/sweep_expert_tiles.py --fma
# up to 64 rows (docs/KERNELS.md).
CONFIG = FmaConfig(2, Tile(8, 512), Tile(16, 512))


@triton.jit
def _run_length(f1, l1, c1, u1, f2, l2, c2, u2):
    # the length of the last run of equal values in a sorted segment (first, last, run, uniform), joined
    same = l1 == f2
    return f1, l2, tl.where(u2 & same, c1 + c2, c2), u1 & u2 & same


@triton.jit
def _plan_kernel(idx_ptr, plan_ptr, P, E, TILES, M: tl.constexpr, P_PAD: tl.constexpr, PDL: tl.constexpr):
    """``plan [TILES, M]``: each routed tile's pairs (indices into the flat ``idx``), -1 where none; the tiles
    in expert order, each expert's pairs in row-major order."""
    pdl.start(PDL)
    slots = tl.arange(0, P_PAD)
    for t0 in range(0, TILES * M, P_PAD):
        tl.store(plan_ptr + t0 + slots, tl.full([P_PAD], -1, tl.int32), mask=t0 + slots < TILES * M)
    tl.debug_barrier()
    expert = tl.load(idx_ptr + slots, mask=slots < P, other=E).to(tl.int32)
    key = tl.sort(expert * P_PAD + slots)
    e, pair = key // P_PAD, key % P_PAD
    _, _, run, _ = tl.associative_scan((e, e, tl.full([P_PAD], 1, tl.int32), e == e), 0, _run_length)
    rank = run - 1
    lead = (rank % M == 0) & (e < E)
    tile = tl.cumsum(lead.to(tl.int32), 0) - 1
    tl.store(plan_ptr + tile * M + rank % M, pair, mask=e < E)


@triton.jit
def _tile_pairs(plan_ptr, idx_ptr, wt_ptr, R, k, ROUTED, M: tl.constexpr):
    """This program's tile: its expert (0 for the shared expert's), whether it is the shared expert's, each of
    its ``M`` pairs' token, output row (token * (k + 1) + slot), weight, and whether the pair is there."""
    t = tl.program_id(0)
    m = tl.arange(0, M)
    shared = t >= ROUTED
    pair = tl.load(plan_ptr + t * M + m, mask=t * M + m < ROUTED * M, other=-1)
    ok = tl.where(shared, (t - ROUTED) * M + m < R, pair >= 0)
    token = tl.where(shared, (t - ROUTED) * M + m, pair // k)
    token = tl.where(ok, token, 0)
    dest = tl.where(ok, token * (k + 1) + tl.where(shared, k, pair % k), 0)
    first = tl.max(pair, 0)  # any of the tile's pairs names its expert
    expert = tl.where(shared, 0, tl.load(idx_ptr + tl.maximum(first, 0)).to(tl.int64))
    weight = tl.where(shared, 1.0, tl.load(wt_ptr + pair, mask=pair >= 0, other=1.0).to(tl.float32))
    return expert, shared, token.to(tl.int64), dest.to(tl.int64), weight, ok


@triton.jit
def _pick(v, m, j):
    return tl.sum(tl.where(m == j, v, 0), 0)


@triton.jit
def _tile_rows(
    a_ptr,
    a_rows,
    n_in,
    w_ptr,
    s_ptr,
    v_ptr,
    vs_ptr,
    row0,
    row_len,
    s_cols,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    GATED: tl.constexpr,
    M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``[M, BLOCK_R]``: weight rows ``[row0, row0 + BLOCK_R)`` of ``w`` (and of ``v`` when ``GATED``) times the
    activations of the rows ``a_rows [M]`` of ``a`` (for MXFP4 weights already times 2^64, :func:`~.tl_common.e2m1`),
    each step's weights decoded once for the ``M`` rows. Each row's products and sums are the same whatever the
    other rows (absent ones included: their results are not stored)."""
    s_ptr = scale_row(s_ptr, row0, s_cols, QUANT, SB_R)
    vs_ptr = scale_row(vs_ptr, row0, s_cols, QUANT, SB_R)
    rows = row0 + tl.arange(0, BLOCK_R)
    m = tl.arange(0, M)
    acc = tl.zeros([M, BLOCK_R, BLOCK_K // VEC], dtype=tl.float32)
    acc_v = tl.zeros([M, BLOCK_R, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in tl.range(0, n_in, BLOCK_K, num_stages=STAGES):
        w = decoded(weight_tile(w_ptr, rows, k0, row_len, QUANT, BLOCK_K), QUANT)
        ws = step_scales(s_ptr, rows, k0, s_cols, QUANT, SB_C, VEC, BLOCK_K)
        if GATED:
            v = decoded(weight_tile(v_ptr, rows, k0, row_len, QUANT, BLOCK_K), QUANT)
            vs = step_scales(vs_ptr, rows, k0, s_cols, QUANT, SB_C, VEC, BLOCK_K)
        for j in tl.static_range(M):
            xv = activations(a_ptr + _pick(a_rows, m, j) * n_in, rows, k0, QUANT, BLOCK_K, 1.0)
            mine = (m == j)[:, None, None]
            acc = tl.where(mine, acc + products(w, ws, xv, QUANT, VEC, BLOCK_K)[None, :, :], acc)
            if GATED:
                acc_v = tl.where(mine, acc_v + products(v, vs, xv, QUANT, VEC, BLOCK_K)[None, :, :], acc_v)
    return tl.sum(acc, axis=2), tl.sum(acc_v, axis=2)


@triton.jit
def _fma_kernel(
    a_ptr,
    ra_ptr,
    plan_ptr,
    idx_ptr,
    wt_ptr,
    out_ptr,
    w_ptr,
    s_ptr,
    v_ptr,
    vs_ptr,
    w_stride,
    s_stride,
    row_len,
    s_cols,
    sw_ptr,
    ss_ptr,
    sv_ptr,
    svs_ptr,
    srow_len,
    ss_cols,
    R,
    k,
    N,
    K,
    ROUTED,
    limit,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    SQUANT: tl.constexpr,
    SSB_R: tl.constexpr,
    SSB_C: tl.constexpr,
    SVEC: tl.constexpr,
    GATE_UP: tl.constexpr,
    CLAMP: tl.constexpr,
    BF16: tl.constexpr,
    M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One tile (module docstring) times weight rows ``[program_id(1) * BLOCK_R, ..)``. ``GATE_UP``: ``a`` the
    tokens ``[R, K]`` as the shared expert's tiles read them and ``ra`` as the routed tiles do (times 2^64 for
    MXFP4 weights), out ``h`` the gated products by (token, slot) in the tokens' dtype (times 2^64 where MXFP4
    weights read them); else ``a`` and ``ra`` are ``h`` and out the fp32 ``weight * w2 h``. The shared expert's
    stacks are the S-prefixed ones."""
    pdl.start(PDL)
    expert, shared, token, dest, weight, ok = _tile_pairs(plan_ptr, idx_ptr, wt_ptr, R, k, ROUTED, M)
    filled = tl.sum(ok.to(tl.int32), 0)
    row0 = tl.program_id(1) * BLOCK_R
    a_rows = token if GATE_UP else dest
    w_ptr += expert * w_stride
    s_ptr += expert * s_stride
    v_ptr += expert * w_stride
    vs_ptr += expert * s_stride
    if shared:
        _tile_out(
            a_ptr,
            a_rows,
            dest,
            weight,
            ok,
            out_ptr,
            sw_ptr,
            ss_ptr,
            sv_ptr,
            svs_ptr,
            row0,
            srow_len,
            ss_cols,
            K,
            N,
            limit,
            SQUANT,
            SSB_R,
            SSB_C,
            SVEC,
            GATE_UP,
            CLAMP,
            BF16,
            BLOCK_R,
            BLOCK_K,
            STAGES,
        )
    elif filled == 1:  # a tile's places fill in order: its one pair alone, without the empty places' products
        _tile_out(
            ra_ptr,
            _first(a_rows, 1),
            _first(dest, 1),
            _first(weight, 1),
            _first(ok.to(tl.int32), 1) > 0,
            out_ptr,
            w_ptr,
            s_ptr,
            v_ptr,
            vs_ptr,
            row0,
            row_len,
            s_cols,
            K,
            N,
            limit,
            QUANT,
            SB_R,
            SB_C,
            VEC,
            GATE_UP,
            CLAMP,
            BF16,
            BLOCK_R,
            BLOCK_K,
            STAGES,
        )
    elif filled > 1:
        _tile_out(
            ra_ptr,
            a_rows,
            dest,
            weight,
            ok,
            out_ptr,
            w_ptr,
            s_ptr,
            v_ptr,
            vs_ptr,
            row0,
            row_len,
            s_cols,
            K,
            N,
            limit,
            QUANT,
            SB_R,
            SB_C,
            VEC,
            GATE_UP,
            CLAMP,
            BF16,
            BLOCK_R,
            BLOCK_K,
            STAGES,
        )


@triton.jit
def _first(v, P: tl.constexpr):
    """The first ``P`` elements of the vector ``v``."""
    i = tl.arange(0, v.shape[0])
    return tl.sum(tl.where(tl.arange(0, P)[:, None] == i[None, :], v[None, :], 0), 1)


@triton.jit
def _tile_out(
    a_ptr,
    a_rows,
    dest,
    weight,
    ok,
    out_ptr,
    w_ptr,
    s_ptr,
    v_ptr,
    vs_ptr,
    row0,
    row_len,
    s_cols,
    K,
    N,
    limit,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    GATE_UP: tl.constexpr,
    CLAMP: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """:func:`_tile_rows` of the places ``a_rows`` (their output rows ``dest``, down weights ``weight``, ``ok`` where
    a pair is) stored: gated and rounded into ``h`` (times 2^64 for MXFP4 weights, which the down launch's products
    take so; exact, a power of two), or the down products times the pair's weight."""
    y, y_v = _tile_rows(
        a_ptr,
        a_rows,
        K,
        w_ptr,
        s_ptr,
        v_ptr,
        vs_ptr,
        row0,
        row_len,
        s_cols,
        QUANT,
        SB_R,
        SB_C,
        VEC,
        GATE_UP,
        a_rows.shape[0],
        BLOCK_R,
        BLOCK_K,
        STAGES,
    )
    n = row0 + tl.arange(0, BLOCK_R)
    out = out_ptr + dest[:, None] * N + n[None, :]
    if GATE_UP:
        h = round_bf16(gated_rounded(y, y_v, limit, CLAMP, BF16), BF16)
        if QUANT == 2:
            h = h * X_SCALE
        tl.store(out, h.to(out_ptr.dtype.element_ty), mask=ok[:, None])
    else:
        tl.store(out, y * weight[:, None], mask=ok[:, None])


def _kernel_formats(w: ExpertStack, sw: ExpertStack) -> dict:
    """The routed and the shared stacks' compile-time parameters (each branch of a program reads one)."""
    return {name: value for name, value in _formats(w, sw).items() if name != "MIXED"}


def routed_tiles(pairs: int, experts: int, per_tile: int) -> int:
    """The most tiles of ``per_tile`` pairs that ``pairs`` pairs over ``experts`` experts can need."""
    return min(pairs, (pairs + (per_tile - 1) * min(experts, pairs)) // per_tile)


def expert_fma(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: tuple[Weight, Weight, Weight],
    shared: tuple[Weight, Weight, Weight],
    limit: float,
    summed: bool = True,
    config: FmaConfig | None = None,
) -> torch.Tensor:
    """:func:`ds4serve.kernels.expert_tiles.expert_tiles` (same arguments and result) with ``config``'s tiles
    (default :data:`CONFIG`). Row ``r``'s result depends on ``x[r]``, ``idx[r]`` and ``weights[r]`` alone."""
    R, D = x.shape
    k = idx.shape[1]
    w1, w3, w2 = (ExpertStack.of(w) for w in experts)
    s1, s3, s2 = (ExpertStack.of(w) for w in shared)
    if (s1.out, s1.inp, s2.out, s2.inp) != (w1.out, w1.inp, w2.out, w2.inp):
        raise ValueError("expert tiles: the shared expert's shapes differ from the routed experts'")
    config = config or CONFIG
    M = config.pairs
    x, idx, weights = x.contiguous(), idx.contiguous(), weights.contiguous()
    E = w1.data.shape[0]
    routed = routed_tiles(R * k, E, M)
    plan = torch.empty(routed * M, device=x.device, dtype=torch.int32)
    p_pad = max(16, triton.next_power_of_2(R * k))
    _plan_kernel[(1,)](idx, plan, R * k, E, routed, M=M, P_PAD=p_pad, num_warps=4, **pdl.launch(x))
    grid0 = routed + triton.cdiv(R, M)
    h = torch.empty(R * (k + 1), w1.out, device=x.device, dtype=x.dtype)
    part = torch.empty(R, k + 1, D, device=x.device, dtype=torch.float32)
    # MXFP4 products take the activations times 2^64 (exact), scaled once here, not in every program
    x64 = x * 2.0**64 if FP4 in (w1.quant, s1.quant) else x
    for target, a, ra, gate_up, (w, v), (sw, sv), tile in (
        (
            h,
            x64 if s1.quant == FP4 else x,
            x64 if w1.quant == FP4 else x,
            True,
            (w1, w3),
            (s1, s3),
            config.gate_up,
        ),
        (part, h, h, False, (w2, w2), (s2, s2), config.down),
    ):
        rows, block_k = _shape(tile, (w, sw))
        _fma_kernel[(grid0, w.out // rows)](
            a,
            ra,
            plan,
            idx,
            weights,
            target,
            w.data,
            w.scale,
            v.data,
            v.scale,
            w.data.stride(0),
            w.s_stride,
            w.row_len,
            w.s_cols,
            sw.data,
            sw.scale,
            sv.data,
            sv.scale,
            sw.row_len,
            sw.s_cols,
            R,
            k,
            w.out,
            w.inp,
            routed,
            float(limit),
            **_kernel_formats(w, sw),
            GATE_UP=gate_up,
            CLAMP=limit > 0,
            BF16=x.dtype == torch.bfloat16,
            M=M,
            BLOCK_R=rows,
            BLOCK_K=block_k,
            STAGES=tile.stages,
            num_warps=tile.warps,
            num_stages=tile.stages,
            **pdl.launch(x),
        )
    return part if not summed else sum_slots(part, x)
