"""The experts of a batched decode step on tensor cores, each row's result independent of the other rows.

Tokens ``x [R, D]`` routed to ``idx [R, k]`` with ``weights [R, k]`` go through their ``k`` routed experts and
the shared expert, which is one more slot (``k + 1`` slots a token), as in :mod:`.moe`. Here a program takes
one expert and a tile of ``BLOCK_M`` of the (token, slot) pairs routed to it, so that the expert's weights are
read once for all the rows that chose it (:mod:`.moe` reads them once a pair): two launches, gate-up (with the
clamped SwiGLU) and down, over a grid fixed by the shapes (CUDA-graph safe, no sort, no host read).

Program ``g < E * T`` (``T``: :func:`programs_per_expert`) serves routed expert ``g // T`` and its row tiles
``g % T, g % T + T, ...``: it reads the routing, ranks the pairs that chose its expert in row-major order and
takes ranks ``t * BLOCK_M ..``; a program whose expert has no such pairs runs no tile. The programs after
them take the shared expert, ``BLOCK_M`` tokens each. A product is ``weight tile @ rows^T`` on the tensor
cores with one tile shape per weight format (:data:`TILES`, never by batch size): every element of it is
summed over the inputs in the same order whatever the other rows of the tile hold, so a pair's result
depends on its token and expert alone. The gate-up writes ``h`` in the activations' dtype (rounded where the
torch code rounds); the down writes each pair's fp32 ``weight * w2 h`` to its token's slot, the shared slot
last with weight 1, and the slots are summed in a fixed order (as :mod:`.moe`'s are). When the shared
expert's format differs from the routed experts', it runs in launches of its own.

MXFP4 routed experts go to :mod:`.expert_fma` instead: decoding their codes, not reading them, bounds these
tiles, and CUDA-core programs that decode a step of an expert's weights once for two pairs are faster up to
64 rows (docs/KERNELS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant import FP4Weight, Weight
from . import pdl
from .expert_fma import expert_fma
from .grouped_experts import dequant_tile, gated_rounded, tile_product
from .moe import ExpertStack, sum_slots
from .tl_common import FP4, FP8, round_bf16

BLOCK_M = 16  # pairs a program takes (the products' narrow side): one for every format and batch size


@dataclass(frozen=True)
class ExpertTile:
    """A launch's shape: ``cols`` output columns a program, ``inputs`` a loop step (lowered to a power of two
    dividing the inputs, within an FP8 scale column), ``warps`` and pipeline ``stages``."""

    cols: int
    inputs: int
    warps: int = 4
    stages: int = 3


# By the weights' format, (gate-up, down): one shape for every batch size (a row's bits must not depend on it).
# MXFP4 experts run in expert_fma.
TILES: dict[str, tuple[ExpertTile, ExpertTile]] = {
    "bf16": (ExpertTile(64, 128), ExpertTile(64, 128)),
    "fp32": (ExpertTile(64, 32, stages=2), ExpertTile(64, 32, stages=2)),
    "fp8": (ExpertTile(64, 128), ExpertTile(64, 128)),
}


@triton.jit
def _expert_tiles_kernel(
    a_ptr,
    idx_ptr,
    wt_ptr,
    out_ptr,
    w_ptr,
    ws_ptr,
    v_ptr,
    vs_ptr,
    sw_ptr,
    sws_ptr,
    sv_ptr,
    svs_ptr,
    R,
    k,
    N,
    K,
    T,
    ROUTED,
    S_ROWS,
    S_COLS,
    limit,
    B0: tl.constexpr,
    B1: tl.constexpr,
    QUANT: tl.constexpr,
    GATE_UP: tl.constexpr,
    CLAMP: tl.constexpr,
    BF16: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    P_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One expert's row tiles (module docstring) times one block of ``BLOCK_N`` output columns. ``GATE_UP``:
    activations ``a [R, K]`` by token, out ``h [R * (k + 1), N]`` by (token, slot), the gated products
    ``swiglu(a w^T, a v^T)``; else activations ``h`` and out ``[R * (k + 1), N]`` fp32, both by (token, slot),
    ``weight * a w^T``. ``ROUTED``: the number of routed programs (0: the shared expert alone)."""
    pdl.start(PDL)
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    g = tl.program_id(0)
    shared = g >= ROUTED
    expert = tl.where(shared, 0, g // T)
    p = tl.arange(0, P_PAD)
    ids = tl.load(idx_ptr + p, mask=p < R * k, other=-1)
    match = (ids == expert) & (g < ROUTED)
    rank = tl.cumsum(match.to(tl.int32), 0) - 1
    count = tl.where(shared, R, tl.sum(match.to(tl.int32), 0))
    first = tl.where(shared, g - ROUTED, g % T)
    stride = tl.where(shared, tl.cdiv(R, BLOCK_M), T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = expert.to(tl.int64) * N + n
    s_rows = expert * S_ROWS + n // B0
    w_base = tl.where(shared, sw_ptr, w_ptr)
    ws_base = tl.where(shared, sws_ptr, ws_ptr)
    v_base = tl.where(shared, sv_ptr, v_ptr)
    vs_base = tl.where(shared, svs_ptr, vs_ptr)
    m = tl.arange(0, BLOCK_M)
    for t in range(first, tl.cdiv(count, BLOCK_M), stride):
        want = t * BLOCK_M + m
        hit = match[None, :] & (rank[None, :] == want[:, None])
        pair = tl.sum(tl.where(hit, p[None, :], 0), 1)
        ok = tl.where(shared, want < R, tl.sum(hit.to(tl.int32), 1) > 0)
        token = tl.where(shared, want, pair // k)
        dest = (token * (k + 1) + tl.where(shared, k, pair % k)).to(tl.int64)
        a_row = token.to(tl.int64) if GATE_UP else dest
        a_tile = a_ptr + a_row[None, :] * K + tl.arange(0, BLOCK_K)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if GATE_UP:
            acc_v = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_tile + k0, mask=ok[None, :], other=0.0)
            w = dequant_tile(
                w_base, ws_base, rows, n_ok, k0, K, s_rows, S_COLS, B0, B1, QUANT, BLOCK_N, BLOCK_K, DTYPE
            )
            acc = tile_product(a, w, acc, True, WIDEN)
            if GATE_UP:
                v = dequant_tile(
                    v_base, vs_base, rows, n_ok, k0, K, s_rows, S_COLS, B0, B1, QUANT, BLOCK_N, BLOCK_K, DTYPE
                )
                acc_v = tile_product(a, v, acc_v, True, WIDEN)
        out = out_ptr + dest[None, :] * N + n[:, None]
        out_ok = ok[None, :] & n_ok[:, None]
        if GATE_UP:
            acc = gated_rounded(acc, acc_v, limit, CLAMP, BF16)
            tl.store(out, round_bf16(acc, BF16).to(DTYPE), mask=out_ok)
        else:
            weight = tl.where(shared, 1.0, tl.load(wt_ptr + pair, mask=ok, other=1.0).to(tl.float32))
            tl.store(out, acc * weight[None, :], mask=out_ok)


def programs_per_expert(R: int, k: int, E: int) -> int:
    """Programs a routed expert gets: its expected tiles (``R * k / E`` pairs an expert), at least one, at most
    the tiles of ``R`` pairs; an expert with more tiles than programs loops over them. Which program runs a
    tile never changes what the tile computes: this shapes the launch, not a pair's bits."""
    return max(1, min(triton.cdiv(R * k, E * BLOCK_M), triton.cdiv(R, BLOCK_M)))


def _step(op: ExpertStack, K: int, tile: ExpertTile) -> int:
    """The loop step: a power of two of at most ``tile.inputs`` dividing ``K`` (FP8: within a scale column;
    MXFP4: whole exponent groups)."""
    step, least = tile.inputs, 32 if op.quant == FP4 else 16
    if op.quant == FP8:
        step = min(step, op.block[1])
    while step >= least and K % step:
        step //= 2
    if step < least or (op.quant == FP8 and op.block[1] % step):
        raise ValueError(f"expert tiles: no loop step of at least {least} inputs divides K={K} ({op.format})")
    return step


def _launch(
    a: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor,
    routed: tuple[ExpertStack, ExpertStack] | None,
    shared: tuple[ExpertStack, ExpertStack] | None,
    limit: float,
    gate_up: bool,
) -> None:
    """One launch over the routed experts' tiles and / or the shared expert's (``(w, v)``: v is w3 in the
    gate-up, unused in the down)."""
    R, k = idx.shape
    w, v = routed or shared
    sw, sv = shared or routed
    N, K = w.data.shape[-2], a.shape[1]
    tile = TILES[w.format][0 if gate_up else 1]
    # routed programs per expert (1, unused, when the launch has no routed experts)
    T = programs_per_expert(R, k, w.data.shape[0]) if routed is not None else 1
    n_routed = w.data.shape[0] * T if routed is not None else 0
    n_shared = triton.cdiv(R, BLOCK_M) if shared is not None else 0
    cols = min(tile.cols, max(16, triton.next_power_of_2(N)))
    b0, b1 = w.block
    _expert_tiles_kernel[(n_routed + n_shared, triton.cdiv(N, cols))](
        a,
        idx,
        weights,
        out,
        w.data,
        w.scale,
        v.data,
        v.scale,
        sw.data,
        sw.scale,
        sv.data,
        sv.scale,
        R,
        k,
        N,
        K,
        T,
        n_routed,
        -(-N // b0),
        -(-K // b1),
        float(limit),
        B0=b0,
        B1=b1,
        QUANT=w.quant,
        GATE_UP=gate_up,
        CLAMP=limit > 0,
        BF16=a.dtype == torch.bfloat16,
        WIDEN=not a.is_cuda or a.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=cols,
        BLOCK_K=_step(w, K, tile),
        P_PAD=max(16, triton.next_power_of_2(R * k)),
        num_warps=tile.warps,
        num_stages=tile.stages,
        **pdl.launch(a),
    )


def expert_tiles(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: tuple[Weight, Weight, Weight],
    shared: tuple[Weight, Weight, Weight],
    limit: float,
    summed: bool = True,
) -> torch.Tensor:
    """``sum_j weights[:, j] * w2[idx[:, j]] swiglu(w1[idx[:, j]] x, w3[idx[:, j]] x)`` plus the shared expert
    (weight 1) for tokens ``x [R, D]`` (bf16 / fp32) routed to ``idx [R, k]``; ``experts`` and ``shared`` are
    ``(w1, w3, w2)``, stacked ``[E, out, in]`` and ``[out, in]``, dense, FP8 or MXFP4. ``summed=False`` returns
    the fp32 slot terms ``[R, k + 1, D]`` (the shared expert last) as :func:`ds4serve.kernels.moe.moe_fused`
    does. Row ``r``'s result depends on ``x[r]``, ``idx[r]`` and ``weights[r]`` alone (bitwise). MXFP4 routed
    experts run in :func:`~.expert_fma.expert_fma`, the others in :func:`tensor_tiles`."""
    tiles = expert_fma if isinstance(experts[0], FP4Weight) else tensor_tiles
    return tiles(x, idx, weights, experts, shared, limit, summed)


def tensor_tiles(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    experts: tuple[Weight, Weight, Weight],
    shared: tuple[Weight, Weight, Weight],
    limit: float,
    summed: bool = True,
) -> torch.Tensor:
    """:func:`expert_tiles` on the tensor cores (module docstring) with the format's tile of :data:`TILES` (MXFP4
    has none; ``bench/sweep_expert_tiles.py`` sets one to time it)."""
    R, D = x.shape
    k = idx.shape[1]
    w1, w3, w2 = (ExpertStack.of(w) for w in experts)
    s1, s3, s2 = (ExpertStack.of(w) for w in shared)
    if (w1.data.shape[-2], w2.data.shape[-2]) != (s1.data.shape[-2], s2.data.shape[-2]):
        raise ValueError("expert tiles: the shared expert's shapes differ from the routed experts'")
    x, idx, weights = x.contiguous(), idx.contiguous(), weights.contiguous()
    h = torch.empty(R * (k + 1), w1.data.shape[-2], device=x.device, dtype=x.dtype)
    part = torch.empty(R, k + 1, D, device=x.device, dtype=torch.float32)
    together = w1.same_format(s1) and w2.same_format(s2)
    for target, a, gate_up, routed, common in (
        (h, x, True, (w1, w3), (s1, s3)),
        (part, h, False, (w2, w2), (s2, s2)),
    ):
        if together:
            _launch(a, idx, weights, target, routed, common, limit, gate_up)
        else:
            _launch(a, idx, weights, target, routed, None, limit, gate_up)
            _launch(a, idx, weights, target, None, common, limit, gate_up)
    return part if not summed else sum_slots(part, x)
