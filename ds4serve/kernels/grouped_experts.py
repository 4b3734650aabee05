"""Grouped GEMMs over quantized experts read in place: the routed experts of a prefill chunk.

Rows ``a [M, K]`` sorted by expert, with int32 cumulative row counts ``ends [E]`` (expert ``e`` owns rows
``ends[e-1] .. ends[e]``), are multiplied by their expert's FP8 (e4m3, fp32 block scales) or MXFP4 (packed
e2m1 pairs, e8m0 exponents per 32 inputs) weight ``w[e] [N, K]``, dequantised tile by tile in registers:
no dense copy of the experts is written, and nothing is read back by the host.

The grid is static: ``cdiv(M, BLOCK_M) + E`` row tiles (an upper bound of ``sum_e cdiv(count_e, BLOCK_M)``)
times ``cdiv(N, BLOCK_N)`` column blocks, so a launch depends on the shapes alone and can be captured in a
CUDA graph. Each program loads ``ends`` as one vector, counts the row tiles of every expert and their
cumulative sum, and finds its expert as the number of experts whose tiles all come before its own index;
programs past the last tile return at once.

Weight tiles are dequantised to the activations' dtype exactly as the weights' ``dequantize`` does
(code times scale in fp32, then one rounding; for MXFP4 and the power-of-two FP8 scales of ds4serve every
value is exact), so the products are the dense path's up to the fp32 summation order.
:func:`grouped_quant_gate_up` runs the gate and up products of a tile together and applies the clamped
SwiGLU before storing (one read of the activations, one launch, no ``[M, 2I]`` intermediate). Tile shapes
come from :data:`TILES`, by format and by the average rows per expert (known from the shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..quant import FP4Weight, FP8Weight, Weight
from . import pdl
from .reference import swiglu_gate
from .tl_common import FP4, FP8, X_SCALE, e2m1, group_scale, round_bf16


@dataclass(frozen=True)
class GroupedTile:
    """Launch shape: ``rows`` of one expert, ``cols`` output columns (weight rows) and ``inputs`` a loop
    step per program (``inputs`` is lowered to a power of two dividing ``K`` and the FP8 scale block);
    ``swap``: the operands swapped (:func:`_grouped_kernel`'s ``SWAP``)."""

    rows: int
    cols: int
    inputs: int
    warps: int
    stages: int
    swap: bool = False


@dataclass(frozen=True)
class Tiles:
    gate_up: GroupedTile
    down: GroupedTile


# By format and by whether the groups are long (at least LONG_GROUP rows per expert on average): the best of
# six tiles, in either operand order, of bench/sweep_grouped.py at DeepSeek-V4-Flash's expert shapes.
LONG_GROUP = 256
# Average (token, slot) rows per expert up to which the model runs a chunk's quantized experts in place (these
# kernels) rather than dequantising groups of experts, at the Flash expert shapes (docs/KERNELS.md).
IN_PLACE_MAX_ROWS_PER_EXPERT = {"fp8": 192, "fp4": 384}
TILES: dict[tuple[str, bool], Tiles] = {
    ("fp8", False): Tiles(GroupedTile(64, 64, 128, 4, 3, swap=True), GroupedTile(64, 128, 128, 8, 3)),
    ("fp4", False): Tiles(
        GroupedTile(64, 64, 128, 4, 3, swap=True), GroupedTile(64, 128, 64, 4, 4, swap=True)
    ),
    ("fp8", True): Tiles(GroupedTile(128, 128, 64, 8, 3, swap=True), GroupedTile(128, 256, 64, 8, 3)),
    ("fp4", True): Tiles(
        GroupedTile(128, 128, 64, 8, 3, swap=True), GroupedTile(128, 128, 64, 8, 3, swap=True)
    ),
}


def tiles_for(w: FP8Weight | FP4Weight, rows: int) -> Tiles:
    """The launch shapes for ``rows`` activation rows over the experts ``w`` (from the shapes alone, so a
    captured graph keeps them)."""
    fmt = "fp4" if isinstance(w, FP4Weight) else "fp8"
    return TILES[fmt, rows >= LONG_GROUP * w.shape[0]]


@triton.jit
def _tile(ends_ptr, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """``(expert, first row, end row)`` of this program's row tile; ``expert >= E`` past the last tile.

    Expert ``e`` has ``cdiv(count_e, BLOCK_M)`` tiles; the tiles of experts ``0..e`` end at ``last[e]`` (their
    inclusive cumulative sum), so tile ``t`` belongs to the first expert with ``last[e] > t``."""
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    end = tl.load(ends_ptr + e, mask=e < E, other=0)
    begin = tl.load(ends_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    tiles = (end - begin + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)
    expert = tl.sum((last <= t).to(tl.int32), 0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, last - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, begin, 0), 0) + (t - first_tile) * BLOCK_M
    return expert, row0, tl.sum(tl.where(mine, end, 0), 0)


@triton.jit
def dequant_tile(
    w_ptr,
    s_ptr,
    rows,
    n_ok,
    k0,
    K,
    s_rows,
    S_COLS,
    B0: tl.constexpr,
    B1: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_K]``: inputs ``k0 ..`` of the flat weight rows ``rows`` (int64, ``expert * N + n``) in
    format ``QUANT`` (:mod:`.tl_common`'s DENSE, FP8 or FP4), dequantised to ``DTYPE``. Dense: read and cast.
    FP8: ``s_rows`` are the rows' scale rows; a step lies in one scale column
    (``BLOCK_K`` divides ``B1``), so one scale a row. MXFP4: the bytes are read as ``[BLOCK_N, groups, 16]``
    so that each group of 32 inputs meets its exponent by broadcasting, and the low / high nibbles are
    interleaved back into input order by a join; a code is decoded by an integer multiply
    (:func:`ds4serve.kernels.tl_common.e2m1`, exact for group exponents up to 192) and scaled by two exact
    powers of two."""
    if QUANT == 2:  # FP4
        g = tl.arange(0, BLOCK_K // 32)
        j = tl.arange(0, 16)
        offsets = rows[:, None, None] * (K // 2) + k0 // 2 + g[None, :, None] * 16 + j[None, None, :]
        codes = tl.load(w_ptr + offsets, mask=n_ok[:, None, None], other=0).to(tl.int32)
        exponents = tl.load(
            s_ptr + rows[:, None] * (K // 32) + k0 // 32 + g[None, :], mask=n_ok[:, None], other=127
        ).to(tl.int32)
        lo, hi = e2m1(codes)  # the value times 2^-126; group_scale: 2^(e - 127 + 62)
        factor = group_scale(exponents)[:, :, None]
        w = tl.reshape(tl.join(lo * X_SCALE * factor, hi * X_SCALE * factor), (BLOCK_N, BLOCK_K))
    elif QUANT == 1:  # FP8
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + s_rows * S_COLS + k0 // B1, mask=n_ok, other=1.0)
        # the GPU's cast rounds to nearest even, as torch's; the interpreter's truncates (exact products alike)
        w = x * s[:, None]
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=n_ok[:, None], other=0.0)
    return w.to(DTYPE)


@triton.jit
def _dot(a, w, acc, WIDEN: tl.constexpr):
    # fp32 operands, exact products: Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns,
    # and fp32 activations must not be rounded to tf32
    if WIDEN:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def tile_product(a, w, acc, SWAP: tl.constexpr, WIDEN: tl.constexpr):
    """``acc + a @ w.T`` for activations ``a`` and a weight tile ``w [BLOCK_N, BLOCK_K]``, or with ``SWAP``
    (``a`` loaded transposed) the transposed products ``acc + w @ a``."""
    if SWAP:
        acc = _dot(w, a, acc, WIDEN)
    else:
        acc = _dot(a, tl.trans(w), acc, WIDEN)
    return acc


@triton.jit
def gated_rounded(g, u, limit, CLAMP: tl.constexpr, BF16: tl.constexpr):
    """:func:`ds4serve.kernels.reference.swiglu_gate` of the fp32 products, rounded where the torch code
    rounds (each product, then silu); the caller rounds the result. Clamping before rounding gives the
    same values (rounding is monotone)."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    g = round_bf16(g, BF16)
    return round_bf16(g / (1.0 + tl.exp(-g)), BF16) * round_bf16(u, BF16)


@triton.jit
def _grouped_kernel(
    a_ptr,
    w_ptr,
    ws_ptr,
    v_ptr,
    vs_ptr,
    ends_ptr,
    out_ptr,
    N,
    K,
    E,
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
    E_PAD: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (expert row tile, column block): ``a @ w[e].T``, or with ``GATE_UP`` the gated
    ``swiglu(a @ w[e].T, a @ v[e].T)``, stored in ``a``'s dtype. bf16 is rounded to nearest even on the
    bits, as by the GPU's cast, so that Triton's interpreter (whose casts truncate) rounds as torch does."""
    pdl.start(PDL)
    expert, row0, row_end = _tile(ends_ptr, E, BLOCK_M, E_PAD)
    if expert >= E:
        return
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    r = row0 + tl.arange(0, BLOCK_M)
    r_ok = r < row_end
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = expert.to(tl.int64) * N + n
    s_rows = expert * S_ROWS + n // B0
    if SWAP:
        # weights as the MMA's first operand (their tile [BLOCK_N, BLOCK_K] stays in registers), the rows'
        # activations transposed as the second: the products come out transposed, [BLOCK_N, BLOCK_M]
        a_tile = a_ptr + r.to(tl.int64)[None, :] * K + tl.arange(0, BLOCK_K)[:, None]
        a_ok = r_ok[None, :]
    else:
        a_tile = a_ptr + r.to(tl.int64)[:, None] * K + tl.arange(0, BLOCK_K)[None, :]
        a_ok = r_ok[:, None]
    ACC_SHAPE: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
    acc = tl.zeros(ACC_SHAPE, dtype=tl.float32)
    if GATE_UP:
        acc_v = tl.zeros(ACC_SHAPE, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_tile + k0, mask=a_ok, other=0.0)
        w = dequant_tile(
            w_ptr, ws_ptr, rows, n_ok, k0, K, s_rows, S_COLS, B0, B1, QUANT, BLOCK_N, BLOCK_K, DTYPE
        )
        acc = tile_product(a, w, acc, SWAP, WIDEN)
        if GATE_UP:
            v = dequant_tile(
                v_ptr, vs_ptr, rows, n_ok, k0, K, s_rows, S_COLS, B0, B1, QUANT, BLOCK_N, BLOCK_K, DTYPE
            )
            acc_v = tile_product(a, v, acc_v, SWAP, WIDEN)
    if GATE_UP:
        acc = gated_rounded(acc, acc_v, limit, CLAMP, BF16)
    if SWAP:
        out = out_ptr + r.to(tl.int64)[None, :] * N + n[:, None]
        out_ok = r_ok[None, :] & n_ok[:, None]
    else:
        out = out_ptr + r.to(tl.int64)[:, None] * N + n[None, :]
        out_ok = r_ok[:, None] & n_ok[None, :]
    tl.store(out, round_bf16(acc, BF16).to(DTYPE), mask=out_ok)


def _block_k(dtype: torch.dtype, w: Weight, tile: GroupedTile) -> int:
    """The loop step for ``w`` under ``tile``, or ValueError where the kernel does not take the operands."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"grouped quantized experts: activations must be bf16 or fp32, not {dtype}")
    if not isinstance(w, (FP8Weight, FP4Weight)) or w.data.dim() != 3:
        raise ValueError("grouped quantized experts: expected stacked FP8 or MXFP4 experts [E, N, K]")
    E, N, K = w.shape
    if isinstance(w, FP8Weight):
        b0, b1 = w.block
        expected = (E, -(-N // b0), -(-K // b1))
        if w.data.dtype != torch.float8_e4m3fn or w.scale.dtype != torch.float32 or w.scale.shape != expected:
            raise ValueError(
                f"grouped FP8 experts: expected e4m3 data and fp32 scales {expected}, got "
                f"{w.data.dtype} and {w.scale.dtype} {tuple(w.scale.shape)}"
            )
        if b1 < 16 or b1 & (b1 - 1):  # a loop step must lie in one scale column
            raise ValueError(
                f"grouped FP8 experts: the scale block's inputs must be a power of two >= 16, got {b1}"
            )
        step, least = min(tile.inputs, b1), 16
    else:
        if w.scale.dtype != torch.uint8 or w.scale.shape != (E, N, K // 32):
            raise ValueError(
                f"grouped MXFP4 experts: expected uint8 exponents {(E, N, K // 32)}, got "
                f"{w.scale.dtype} {tuple(w.scale.shape)}"
            )
        step, least = tile.inputs, 32
    while step >= least and K % step:
        step //= 2
    if step < least:
        raise ValueError(f"grouped quantized experts: no loop step of at least {least} inputs divides K={K}")
    return step


def supports(dtype: torch.dtype, w: Weight, w3: Weight | None = None) -> bool:
    """Whether :func:`grouped_quant_mm` (with ``w3``: :func:`grouped_quant_gate_up`) takes activations of
    ``dtype`` and these experts; where not, the caller runs its other paths."""
    try:
        for t in TILES.values():
            _block_k(dtype, w, t.gate_up)
            _block_k(dtype, w, t.down)
        if w3 is not None:
            _check_pair(w, w3)
    except ValueError:
        return False
    return True


def _check_pair(w1: Weight, w3: Weight) -> None:
    same = (
        type(w1) is type(w3)
        and w1.shape == w3.shape
        and getattr(w1, "block", None) == getattr(w3, "block", None)
    )
    if not same:
        raise ValueError("grouped gate-up: w1 and w3 must have one format, shape and scale block")


def grouped_quant_mm(
    a: torch.Tensor, w: FP8Weight | FP4Weight, ends: torch.Tensor, tile: GroupedTile | None = None
) -> torch.Tensor:
    """``[M, N]``: rows ``ends[e-1] .. ends[e]`` of ``a [M, K]`` times ``dense(w[e]).T`` for stacked experts
    ``w [E, N, K]``, in ``a``'s dtype (bf16, or fp32). Rows from ``ends[-1]`` on are not written (their
    values are undefined). No host synchronisation; ValueError for operands :func:`supports` refuses.
    ``tile``: the launch shape, by default :func:`tiles_for`'s."""
    return _launch(a, w, None, ends, 0.0, tile or tiles_for(w, a.shape[0]).down)


def grouped_quant_gate_up(
    a: torch.Tensor,
    w1: FP8Weight | FP4Weight,
    w3: FP8Weight | FP4Weight,
    ends: torch.Tensor,
    limit: float,
    tile: GroupedTile | None = None,
) -> torch.Tensor:
    """``swiglu_gate(grouped_quant_mm(a, w1, ends), grouped_quant_mm(a, w3, ends), limit)`` in one launch:
    the activations are read once for both products, and the two products never leave registers.
    ``tile``: by default :func:`tiles_for`'s."""
    _check_pair(w1, w3)
    return _launch(a, w1, w3, ends, limit, tile or tiles_for(w1, a.shape[0]).gate_up)


def _operands(w: FP8Weight | FP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    data = w.data.contiguous()
    return (data.view(torch.uint8) if isinstance(w, FP4Weight) else data), w.scale.contiguous()


def _launch(
    a: torch.Tensor,
    w: FP8Weight | FP4Weight,
    w3: FP8Weight | FP4Weight | None,
    ends: torch.Tensor,
    limit: float,
    tile: GroupedTile,
) -> torch.Tensor:
    E, N, K = w.shape
    if a.dim() != 2 or a.shape[1] != K or ends.shape != (E,):
        raise ValueError(
            f"grouped quantized experts: rows {tuple(a.shape)} and ends {tuple(ends.shape)} do not "
            f"match experts {tuple(w.shape)}"
        )
    step = _block_k(a.dtype, w, tile)
    b0, b1 = w.block if isinstance(w, FP8Weight) else (1, 32)
    a = a.contiguous()
    out = torch.empty(a.shape[0], N, dtype=a.dtype, device=a.device)
    data, scale = _operands(w)
    data3, scale3 = _operands(w3) if w3 is not None else (data, scale)
    cols = min(tile.cols, max(16, triton.next_power_of_2(N)))
    grid = (triton.cdiv(a.shape[0], tile.rows) + E, triton.cdiv(N, cols))
    _grouped_kernel[grid](
        a,
        data,
        scale,
        data3,
        scale3,
        ends.to(torch.int32).contiguous(),
        out,
        N,
        K,
        E,
        -(-N // b0),
        -(-K // b1),
        limit,
        B0=b0,
        B1=b1,
        QUANT=FP4 if isinstance(w, FP4Weight) else FP8,
        GATE_UP=w3 is not None,
        CLAMP=limit > 0,
        BF16=a.dtype == torch.bfloat16,
        WIDEN=not a.is_cuda or a.dtype == torch.float32,
        BLOCK_M=tile.rows,
        BLOCK_N=cols,
        BLOCK_K=step,
        E_PAD=max(16, triton.next_power_of_2(E)),
        SWAP=tile.swap,
        num_warps=tile.warps,
        num_stages=tile.stages,
        **pdl.launch(a),
    )
    return out


def grouped_quant_mm_ref(a: torch.Tensor, w: Weight, ends: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`grouped_quant_mm`: the experts dequantised by ``dequantize``, a product per
    expert over host-read group ends; rows from ``ends[-1]`` on are zero."""
    return _per_expert(a, ends, lambda part, e: F.linear(part, w[e].dequantize(a.dtype)), w.shape[1])


def grouped_quant_gate_up_ref(
    a: torch.Tensor, w1: Weight, w3: Weight, ends: torch.Tensor, limit: float
) -> torch.Tensor:
    """Torch reference of :func:`grouped_quant_gate_up` (as :func:`grouped_quant_mm_ref`)."""

    def gated(part: torch.Tensor, e: int) -> torch.Tensor:
        return swiglu_gate(
            F.linear(part, w1[e].dequantize(a.dtype)), F.linear(part, w3[e].dequantize(a.dtype)), limit
        )

    return _per_expert(a, ends, gated, w1.shape[1])


def _per_expert(
    a: torch.Tensor, ends: torch.Tensor, product: Callable[[torch.Tensor, int], torch.Tensor], n: int
) -> torch.Tensor:
    out = a.new_zeros(a.shape[0], n)
    begin = 0
    for e, end in enumerate(ends.tolist()):
        if end > begin:
            out[begin:end] = product(a[begin:end], e)
        begin = end
    return out
