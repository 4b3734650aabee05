"""The mHC stream products of a chunk in one pass each: the mixes and the collapse before a sublayer, the merge
after it.

For a prefill chunk the torch code spends most of an mHC site in layout work, not arithmetic: the
merge is a batch of ``S`` tiny ``[hc, hc] @ [hc, D]`` products (cuBLAS runs it as a batched GEMM of
``M = hc``) plus a broadcast, and the collapse materialises an fp32 ``[S, hc, D]`` product before
summing it. Here one program per (token, block of D) reads the token's ``hc`` stream rows once.
Rounding follows :func:`ds4serve.model.hyper.hc_merge` / ``_collapse``: the merge rounds ``post * out``
and the fp32 stream mix to the streams' dtype before adding them; the collapse sums in fp32.

The mixes (:func:`hc_mixes`) are the torch code's
``F.linear(unweighted_rms_norm(X.flatten().float()), fn)`` with the norm's factor applied to each row's 24
sums instead of to its 16,384 inputs, as the decode site's kernel does (:mod:`ds4serve.kernels.hc_pre`). The
torch code writes the normalised rows in fp32 (twice the streams' bytes) for cuBLAS's fp32 GEMM to read back;
here the bf16 streams are read once and multiplied on bf16 tensor cores, ``fn`` split in registers into
three bf16 pieces (``hi + mid + lo`` carries its 24 bits): each product exact, the sums in fp32. So the mixes
equal the torch code's up to fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl

BLOCK_D = 1024
# Launch options of every kernel that calls merged(): without floating-point contraction. With it, the
# compiler turns "round post_k * out to bf16, then add the rounded mix" into one bf16 fused multiply-add,
# which skips the product's rounding (sm_90 PTX ``fma.rn.bf16``): the merge then differs from hc_merge's
# by about one bf16 rounding.
EXACT_ROUNDING = {"enable_fp_fusion": False}


@triton.jit
def merged(x_row, o, post_row, comb_row, k, d, mask, D, HC: tl.constexpr, BLOCK: tl.constexpr):
    """Stream ``k`` of the merge at columns ``d`` (``k`` one stream, or one per column: then ``[BLOCK]``
    indices, each < ``HC``), ``post_k * out + sum_j comb[j, k] X_j`` for the token's streams at ``x_row``, its
    fp32 ``post`` and ``comb`` at ``post_row`` and ``comb_row`` and its sublayer output ``o [BLOCK]`` (fp32
    values), rounded to X's dtype as ``hc_merge`` rounds: ``post_k * out`` and the fp32 sum of the mix each,
    then their sum (only when launched with :data:`EXACT_ROUNDING`)."""
    dtype = x_row.dtype.element_ty
    mix = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(HC):
        c = tl.load(comb_row + j * HC + k).to(dtype).to(tl.float32)
        mix += c * tl.load(x_row + j * D + d, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(post_row + k).to(dtype).to(tl.float32)
    return ((p * o).to(dtype).to(tl.float32) + mix.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _merge_kernel(
    x_ptr, out_ptr, post_ptr, comb_ptr, y_ptr, D, HC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.start(PDL)
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    o = tl.load(out_ptr + s * D + d, mask=dm, other=0.0).to(tl.float32)
    for k in tl.static_range(HC):
        y = merged(x_ptr + s * HC * D, o, post_ptr + s * HC, comb_ptr + s * HC * HC, k, d, dm, D, HC, BLOCK)
        tl.store(y_ptr + (s * HC + k) * D + d, y, mask=dm)


@triton.jit
def _collapse_kernel(x_ptr, pre_ptr, y_ptr, D, HC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(HC):
        acc += tl.load(pre_ptr + s * HC + k) * tl.load(x_ptr + (s * HC + k) * D + d, mask=dm, other=0.0).to(
            tl.float32
        )
    tl.store(y_ptr + s * D + d, acc.to(y_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _mixes_part_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    S,
    N,
    SPAN,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows ``[BLOCK_S]`` of the flattened bf16 streams times ``fn`` over this program's ``SPAN`` inputs: the
    partial products and sum of squares, at ``part [programs_n, S, MIX_PAD + 1]`` (the squares last)."""
    pdl.start(PDL)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rm = rows < S
    m = tl.arange(0, MIX_PAD)
    mm = m < MIX
    acc = tl.zeros([BLOCK_S, MIX_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_S], dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * N
    start = tl.program_id(1) * SPAN
    for n0 in range(start, start + SPAN, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        x = tl.load(x_rows + n[None, :], mask=rm[:, None], other=0.0)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        f = tl.load(fn_ptr + m[None, :] * N + n[:, None], mask=mm[None, :], other=0.0)
        hi = f.to(tl.bfloat16)
        rest = f - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        if WIDEN:  # Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; fp32 is exact
            acc = tl.dot(xf, hi.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, lo.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, hi, acc)
            acc = tl.dot(x, mid, acc)
            acc = tl.dot(x, lo, acc)
    out = part_ptr + (tl.program_id(1) * S + rows.to(tl.int64)) * (MIX_PAD + 1)
    tl.store(out[:, None] + m[None, :], acc, mask=rm[:, None])
    tl.store(out + MIX_PAD, sq, mask=rm)


@triton.jit
def _mixes_sum_kernel(
    part_ptr,
    y_ptr,
    S,
    N,
    eps,
    PARTS: tl.constexpr,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    """The mixes of rows ``[BLOCK_S]`` from their ``PARTS`` partials, summed in order:
    ``rsqrt(squares / N + eps) * products``."""
    pdl.start(PDL)
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    rm = rows < S
    m = tl.arange(0, MIX_PAD)
    acc = tl.zeros([BLOCK_S, MIX_PAD], dtype=tl.float32)
    sq = tl.zeros([BLOCK_S], dtype=tl.float32)
    for p in tl.static_range(PARTS):
        at = part_ptr + (p * S + rows.to(tl.int64)) * (MIX_PAD + 1)
        acc += tl.load(at[:, None] + m[None, :], mask=rm[:, None], other=0.0)
        sq += tl.load(at + MIX_PAD, mask=rm, other=0.0)
    y = acc * tl.rsqrt(sq / N + eps)[:, None]
    tl.store(y_ptr + rows[:, None] * MIX + m[None, :], y, mask=rm[:, None] & (m[None, :] < MIX))


@dataclass(frozen=True)
class MixTile:
    """Launch shape of :func:`hc_mixes`: rows and inputs a loop step of one program takes, how many programs split
    a row's inputs (their partial sums added in order by a second launch), warps, loop stages."""

    rows: int = 64
    inputs: int = 128
    parts: int = 8
    warps: int = 4
    stages: int = 3


# Programs of 64 rows read fn a quarter as often as of 16; splitting the inputs over 8 programs puts a 2048-token
# chunk's 32 row blocks on every SM (bench/sweep_mixes.py, docs/KERNELS.md). The split depends on the tile alone:
# a row's mixes are the same in any chunk.
MIX_TILE = MixTile()
SUM_ROWS = 64  # rows per program of the partials' sum


def mixes_apply(X: torch.Tensor) -> bool:
    """Whether :func:`hc_mixes` takes streams like ``X``: bf16 (the tensor-core operand; the products of
    other dtypes would not be exact) whose flattened rows split into whole steps of the kernel's loop."""
    return X.dtype == torch.bfloat16 and (X.shape[1] * X.shape[2]) % (MIX_TILE.inputs * MIX_TILE.parts) == 0


def hc_mixes(X: torch.Tensor, fn: torch.Tensor, eps: float, tile: MixTile = MIX_TILE) -> torch.Tensor:
    """fp32 mixes ``[S, mix]`` of bf16 streams ``X [S, hc, D]`` (:func:`mixes_apply`): for each flattened row
    ``x``, ``rsqrt(mean(x^2) + eps) * (x @ fn.T)`` with ``fn [mix, hc * D]`` in fp32. ``tile``: the launch
    shape."""
    if X.dtype != torch.bfloat16 or (X.shape[1] * X.shape[2]) % (tile.inputs * tile.parts):
        raise ValueError(
            f"hc_mixes: expected bf16 streams of a multiple of {tile.inputs * tile.parts} values a row, got "
            f"{X.dtype} {tuple(X.shape)}"
        )
    S = X.shape[0]
    x = X.reshape(S, -1).contiguous()
    N, mix = x.shape[1], fn.shape[0]
    mix_pad = max(16, triton.next_power_of_2(mix))
    part = torch.empty(tile.parts, S, mix_pad + 1, device=X.device, dtype=torch.float32)
    _mixes_part_kernel[(triton.cdiv(S, tile.rows), tile.parts)](
        x,
        fn.float().contiguous(),
        part,
        S,
        N,
        N // tile.parts,
        MIX=mix,
        MIX_PAD=mix_pad,
        BLOCK_S=tile.rows,
        BLOCK_N=tile.inputs,
        WIDEN=not X.is_cuda,
        num_warps=tile.warps,
        num_stages=tile.stages,
        **pdl.launch(X),
    )
    y = torch.empty(S, mix, device=X.device, dtype=torch.float32)
    _mixes_sum_kernel[(triton.cdiv(S, SUM_ROWS),)](
        part,
        y,
        S,
        N,
        eps,
        PARTS=tile.parts,
        MIX=mix,
        MIX_PAD=mix_pad,
        BLOCK_S=SUM_ROWS,
        num_warps=4,
        **pdl.launch(X),
    )
    return y


def hc_merge(X: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_k = post_k * out + sum_j comb[j, k] X_j`` for streams ``X [S, hc, D]``, ``out [S, D]``,
    fp32 ``post [S, hc]`` and ``comb [S, hc, hc]``."""
    S, hc, D = X.shape
    X, out = X.contiguous(), out.to(X.dtype).contiguous()
    y = torch.empty_like(X)
    block = min(BLOCK_D, triton.next_power_of_2(D))
    _merge_kernel[(S, triton.cdiv(D, block))](
        X,
        out,
        post.float().contiguous(),
        comb.float().contiguous(),
        y,
        D,
        HC=hc,
        BLOCK=block,
        num_warps=4,
        **EXACT_ROUNDING,
        **pdl.launch(X),
    )
    return y


def hc_collapse(pre: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``sum_k pre_k X_k`` in fp32, cast to X's dtype: ``[S, D]`` for fp32 ``pre [S, hc]``."""
    S, hc, D = X.shape
    X = X.contiguous()
    y = torch.empty(S, D, device=X.device, dtype=X.dtype)
    block = min(BLOCK_D, triton.next_power_of_2(D))
    _collapse_kernel[(S, triton.cdiv(D, block))](
        X, pre.float().contiguous(), y, D, HC=hc, BLOCK=block, num_warps=4, **pdl.launch(X)
    )
    return y
