"""GEMV for a few activation rows (decode): ``y = x W^T`` with every weight byte read once per call.

``x [N, K]`` (N independent tokens, up to 8 in the model, 16 at most) times ``W [R, K]`` gives ``[N, R]`` in
``x``'s dtype with fp32 accumulation. ``W`` is dense (bf16 / fp32) or float8 e4m3 with fp32 block scales
``[ceil(R/b0), ceil(K/b1)]``, dequantised in registers. ``groups > 1`` is the grouped low-rank output projection:
output rows ``[g R/G, (g+1) R/G)`` read input group ``g`` of ``x [N, G, K]``. :func:`gemv_ref` is the torch
reference.

One launcher, three kinds of tile (:class:`GemvConfig`); a loop step reads ``BLOCK_K`` inputs as sub-tiles of one
FP8 scale column each, so a block scale is one number per sub-tile:

* CUDA cores (``dot=False``): an fp32 accumulator reduced over K once at the end; a program's rows lie in one
  scale row, so an FP8 scale multiplies the activations. Any dtype; the only path for fp32 activations.
* tensor cores (``dot=True``, bf16 activations, tokens padded to 16): FP8 multiplies in fp16 (e4m3 -> fp16 is
  exact), the activations scaled by ``2**-8`` on the way (every bf16 value from ``2**-6`` to ``2**24`` stays
  exact) and the partial scaled back; products exact, sums in fp32.
* vector tiles (``vec=True``, one token): :func:`ds4serve.kernels.tl_common.rows_dot`, the fused MoE's down
  product; with ``early`` the first step's weights are read before the PDL wait.

Loops run under ``tl.range(num_stages=...)`` so that Triton pipelines the weight loads. Split-K (``split > 1``)
writes fp32 partials that a second launch sums in a fixed order (deterministic). :func:`default_config` reads
:data:`TABLE` (per shape; a heuristic for other shapes). :func:`gemv_pair` runs two products of one input in one
launch when both take CUDA-core or both vector tiles without split-K: the results are the two launches', bit for
bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant import dequant_fp8
from . import pdl
from .tl_common import DENSE, FP8, accumulate, activations, rows_dot, scale_row, step_scales, weight_tile

DOT_ROWS = 16  # activation rows of the tensor-core tile: tl.dot needs at least 16
SMS = 132  # streaming multiprocessors of the target GPU (H200)
TABLED_BLOCK = (128, 128)  # the FP8 scale block of real checkpoints, which the table was swept with


@dataclass(frozen=True)
class GemvConfig:
    block_r: int  # weight rows per program (a power of two)
    block_k: int  # inputs per loop step (a power of two)
    split: int = 1  # slices of the input, one program each; summed by a second launch
    warps: int = 4
    stages: int = 4  # loop steps in flight (cp.async pipeline depth)
    dot: bool = False  # tensor cores: tl.dot with the activations padded to 16 rows
    vec: bool = False  # one token: the fused MoE's vector product (CUDA cores, unmasked tiles)
    early: bool = False  # vector tiles: the first step's weights read before the PDL wait


# (kind, R, K, N bucket (1 or 4), groups) -> config, for DeepSeek-V4-Flash's decode projections; FP8
# entries hold for 128x128 scale blocks. The fastest passing config per shape of `bench/sweep_gemv.py`
# (docs/KERNELS.md).
TABLE: dict[tuple[str, int, int, int, int], GemvConfig] = {
    ("bf16", 64, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 64, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 256, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 256, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 512, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 512, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 1024, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 1024, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 2048, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 2048, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 4096, 2048, 1, 1): GemvConfig(block_r=16, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 4096, 2048, 4, 1): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=6, dot=True),
    ("bf16", 4096, 8192, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 4096, 8192, 4, 1): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=6, dot=True),
    ("bf16", 8192, 1024, 1, 1): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=6, dot=True),
    ("bf16", 8192, 1024, 4, 1): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=6, dot=True),
    ("bf16", 8192, 4096, 1, 8): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=6, dot=True),
    ("bf16", 8192, 4096, 4, 8): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=6, dot=True),
    ("bf16", 32768, 1024, 1, 1): GemvConfig(block_r=128, block_k=128, split=1, warps=8, stages=3, dot=True),
    ("bf16", 32768, 1024, 4, 1): GemvConfig(block_r=128, block_k=128, split=1, warps=8, stages=3, dot=True),
    ("bf16", 129280, 4096, 1, 1): GemvConfig(block_r=32, block_k=256, split=1, warps=2, stages=4, dot=True),
    ("bf16", 129280, 4096, 4, 1): GemvConfig(block_r=128, block_k=128, split=1, warps=4, stages=4, dot=True),
    # FP8 with fp16 tensor-core operands, swept with PDL on: bench/sweep_gemv.py --kinds fp8
    ("fp8", 64, 4096, 1, 1): GemvConfig(block_r=4, block_k=1024, split=2, warps=1, stages=4, dot=False),
    ("fp8", 64, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=4, warps=2, stages=4, dot=False),
    ("fp8", 256, 4096, 1, 1): GemvConfig(block_r=4, block_k=1024, split=2, warps=1, stages=4, dot=False),
    ("fp8", 256, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=4, warps=2, stages=4, dot=False),
    ("fp8", 512, 4096, 1, 1): GemvConfig(block_r=4, block_k=1024, split=1, warps=1, stages=4, dot=False),
    ("fp8", 512, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=2, warps=2, stages=4, dot=False),
    ("fp8", 1024, 4096, 1, 1): GemvConfig(block_r=4, block_k=1024, split=1, warps=1, stages=4, dot=False),
    ("fp8", 1024, 4096, 4, 1): GemvConfig(block_r=16, block_k=128, split=4, warps=1, stages=8, dot=True),
    ("fp8", 1536, 4096, 1, 1): GemvConfig(block_r=4, block_k=1024, split=1, warps=1, stages=4, dot=False),
    ("fp8", 1536, 4096, 4, 1): GemvConfig(block_r=16, block_k=128, split=4, warps=1, stages=8, dot=True),
    ("fp8", 2048, 4096, 1, 1): GemvConfig(block_r=4, block_k=1024, split=1, warps=1, stages=4, dot=False),
    ("fp8", 2048, 4096, 4, 1): GemvConfig(block_r=32, block_k=128, split=4, warps=2, stages=4, dot=True),
    ("fp8", 4096, 2048, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("fp8", 4096, 2048, 4, 1): GemvConfig(block_r=32, block_k=128, split=2, warps=2, stages=4, dot=True),
    ("fp8", 4096, 8192, 1, 1): GemvConfig(block_r=16, block_k=128, split=2, warps=1, stages=8, dot=True),
    ("fp8", 4096, 8192, 4, 1): GemvConfig(block_r=32, block_k=128, split=4, warps=2, stages=4, dot=True),
    ("fp8", 8192, 1024, 1, 1): GemvConfig(block_r=16, block_k=256, split=1, warps=1, stages=4, dot=True),
    ("fp8", 8192, 1024, 4, 1): GemvConfig(block_r=32, block_k=128, split=1, warps=2, stages=4, dot=True),
    ("fp8", 8192, 4096, 1, 8): GemvConfig(block_r=16, block_k=128, split=1, warps=1, stages=8, dot=True),
    ("fp8", 8192, 4096, 4, 8): GemvConfig(block_r=32, block_k=256, split=1, warps=2, stages=4, dot=True),
    ("fp8", 32768, 1024, 1, 1): GemvConfig(block_r=32, block_k=128, split=1, warps=2, stages=4, dot=True),
    ("fp8", 32768, 1024, 4, 1): GemvConfig(block_r=16, block_k=256, split=1, warps=1, stages=4, dot=True),
    ("fp8", 40960, 1024, 1, 1): GemvConfig(block_r=32, block_k=256, split=1, warps=2, stages=6, dot=True),
    ("fp8", 40960, 1024, 4, 1): GemvConfig(block_r=16, block_k=256, split=1, warps=1, stages=4, dot=True),
    # concatenated input projections (model/projections.py): bench/sweep_gemv.py --only fused --quick
    ("bf16", 1536, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 1536, 4096, 4, 1): GemvConfig(block_r=4, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 2560, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 2560, 4096, 4, 1): GemvConfig(block_r=32, block_k=256, split=1, warps=2, stages=4, dot=True),
    ("bf16", 2624, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 2624, 4096, 4, 1): GemvConfig(block_r=32, block_k=256, split=1, warps=2, stages=4, dot=True),
    ("bf16", 4160, 4096, 1, 1): GemvConfig(block_r=8, block_k=512, split=1, warps=2, stages=4, dot=False),
    ("bf16", 4160, 4096, 4, 1): GemvConfig(block_r=32, block_k=256, split=1, warps=2, stages=4, dot=True),
    ("bf16", 40960, 1024, 1, 1): GemvConfig(block_r=16, block_k=512, split=1, warps=4, stages=4, dot=False),
    ("bf16", 40960, 1024, 4, 1): GemvConfig(block_r=64, block_k=128, split=1, warps=4, stages=4, dot=True),
}


@triton.jit
def _store(out_ptr, y, offsets, mask, split, n_tokens, n_rows, PARTIAL: tl.constexpr):
    if PARTIAL:
        tl.store(out_ptr + split * n_tokens * n_rows + offsets, y, mask=mask)
    else:
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


FP8_X_SCALE = 2.0**-8  # activations' scale on the way to fp16 operands (see the module docstring)


@triton.jit
def _scaled_activations(
    x_base,
    x_stride,
    cols,
    cmask,
    n_tokens,
    DTYPE: tl.constexpr,
    SUB_K: tl.constexpr,
    N_PAD: tl.constexpr,
    N_LOAD: tl.constexpr,
    X_SCALE: tl.constexpr,
):
    # The [SUB_K, N_PAD] operand of an FP8 sub-tile: the N_LOAD (a power of two >= n_tokens) real
    # token columns are loaded, scaled and converted once each, then repeated: column c is token
    # c % N_LOAD.
    tokens = tl.arange(0, N_LOAD)
    x = tl.load(
        x_base + tokens[None, :] * x_stride + cols[:, None],
        mask=cmask[:, None] & (tokens < n_tokens)[None, :],
        other=0.0,
    )
    x = (x.to(tl.float32) * X_SCALE).to(DTYPE)
    if N_LOAD < N_PAD:
        x = tl.reshape(tl.broadcast_to(x[:, None, :], [SUB_K, N_PAD // N_LOAD, N_LOAD]), [SUB_K, N_PAD])
    return x


@triton.jit
def _scale(
    s_ptr, rows, rmask, first, kc, s_cols, SB_R: tl.constexpr, SB_C: tl.constexpr, PER_ROW: tl.constexpr
):
    # The block scale of inputs [kc, kc + SUB_K): one scalar, or one per row when a tile spans scale
    # rows. A sub-tile past the input's end (all weights masked to 0) reads the last scale column.
    col = tl.minimum(kc // SB_C, s_cols - 1)
    if PER_ROW:
        s = tl.load(s_ptr + (rows // SB_R) * s_cols + col, mask=rmask, other=0.0)[:, None]
    else:
        s = tl.load(s_ptr + (first // SB_R) * s_cols + col)
    return s


@triton.jit
def _program(pid, split, n_rows, n_in, k_per_split, n_tokens, BLOCK_R: tl.constexpr, N_PAD: tl.constexpr):
    # Program (pid, split)'s output rows and token slots with their masks, and its slice [k_lo, k_hi) of
    # the input.
    first = pid * BLOCK_R
    rows = first + tl.arange(0, BLOCK_R)
    tokens = tl.arange(0, N_PAD)
    k_lo = split * k_per_split
    return (
        first,
        split,
        rows,
        tokens,
        rows < n_rows,
        tokens < n_tokens,
        k_lo,
        tl.minimum(k_lo + k_per_split, n_in),
    )


@triton.jit(do_not_specialize=["rows_per_group", "s_cols", "n_tokens"])
def _gemv_fma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_in,
    k_per_split,
    rows_per_group,
    x_stride,
    s_cols,
    n_tokens,
    SCALED: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    STAGES: tl.constexpr,
    PARTIAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    _fma_program(
        tl.program_id(0),
        tl.program_id(1),
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        n_rows,
        n_in,
        k_per_split,
        rows_per_group,
        x_stride,
        s_cols,
        n_tokens,
        SCALED,
        SB_R,
        SB_C,
        N_PAD,
        BLOCK_R,
        BLOCK_K,
        SUB_K,
        STAGES,
        PARTIAL,
    )


@triton.jit(do_not_specialize=["s_cols_a", "s_cols_b", "n_tokens"])
def _gemv_fma_pair_kernel(
    x_ptr,
    x_stride,
    n_in,
    n_tokens,
    programs_a,
    wa_ptr,
    sa_ptr,
    outa_ptr,
    rows_a,
    s_cols_a,
    wb_ptr,
    sb_ptr,
    outb_ptr,
    rows_b,
    s_cols_b,
    N_PAD: tl.constexpr,
    A_SCALED: tl.constexpr,
    A_SB_R: tl.constexpr,
    A_SB_C: tl.constexpr,
    A_BLOCK_R: tl.constexpr,
    A_BLOCK_K: tl.constexpr,
    A_SUB_K: tl.constexpr,
    A_STAGES: tl.constexpr,
    B_SCALED: tl.constexpr,
    B_SB_R: tl.constexpr,
    B_SB_C: tl.constexpr,
    B_BLOCK_R: tl.constexpr,
    B_BLOCK_K: tl.constexpr,
    B_SUB_K: tl.constexpr,
    B_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # Two products of one input in one launch (gemv_pair): the first programs_a programs are product a's,
    # the rest product b's, each with its own weight format and tiles.
    pdl.start(PDL)
    pid = tl.program_id(0)
    if pid < programs_a:
        _fma_program(
            pid,
            0,
            x_ptr,
            wa_ptr,
            sa_ptr,
            outa_ptr,
            rows_a,
            n_in,
            n_in,
            rows_a,
            x_stride,
            s_cols_a,
            n_tokens,
            A_SCALED,
            A_SB_R,
            A_SB_C,
            N_PAD,
            A_BLOCK_R,
            A_BLOCK_K,
            A_SUB_K,
            A_STAGES,
            False,
        )
    else:
        _fma_program(
            pid - programs_a,
            0,
            x_ptr,
            wb_ptr,
            sb_ptr,
            outb_ptr,
            rows_b,
            n_in,
            n_in,
            rows_b,
            x_stride,
            s_cols_b,
            n_tokens,
            B_SCALED,
            B_SB_R,
            B_SB_C,
            N_PAD,
            B_BLOCK_R,
            B_BLOCK_K,
            B_SUB_K,
            B_STAGES,
            False,
        )


@triton.jit
def _fma_program(
    pid,
    split,
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_in,
    k_per_split,
    rows_per_group,
    x_stride,
    s_cols,
    n_tokens,
    SCALED: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    STAGES: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    # A step reads BLOCK_K inputs as sub-tiles of SUB_K (one scale column each, for FP8), so that the
    # scale is one number per sub-tile and the accumulator holds only SUB_K columns.
    first, split, rows, tokens, rmask, tmask, k_lo, k_hi = _program(
        pid, split, n_rows, n_in, k_per_split, n_tokens, BLOCK_R, N_PAD
    )
    w_rows = w_ptr + rows[None, :, None].to(tl.int64) * n_in
    x_rows = x_ptr + tokens[:, None, None] * x_stride + (first // rows_per_group) * n_in
    acc = tl.zeros([N_PAD, BLOCK_R, SUB_K], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        for j in tl.static_range(BLOCK_K // SUB_K):
            cols = k0 + j * SUB_K + tl.arange(0, SUB_K)[None, None, :]
            cmask = cols < k_hi
            w = tl.load(w_rows + cols, mask=rmask[None, :, None] & cmask, other=0.0).to(tl.float32)
            xs = tl.load(x_rows + cols, mask=tmask[:, None, None] & cmask, other=0.0).to(tl.float32)
            if SCALED:
                xs *= _scale(s_ptr, rows, rmask, first, k0 + j * SUB_K, s_cols, SB_R, SB_C, False)
            acc += w * xs
    y = tl.sum(acc, axis=2)
    _store(
        out_ptr,
        y,
        tokens[:, None] * n_rows + rows[None, :],
        tmask[:, None] & rmask[None, :],
        split,
        n_tokens,
        n_rows,
        PARTIAL,
    )


@triton.jit(do_not_specialize=["rows_per_group", "s_cols", "n_tokens"])
def _gemv_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_in,
    k_per_split,
    rows_per_group,
    x_stride,
    s_cols,
    n_tokens,
    SCALED: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    STAGES: tl.constexpr,
    PARTIAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    N_LOAD: tl.constexpr,
    X_SCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    first, split, rows, tokens, rmask, tmask, k_lo, k_hi = _program(
        tl.program_id(0), tl.program_id(1), n_rows, n_in, k_per_split, n_tokens, BLOCK_R, N_PAD
    )
    pdl.start(PDL)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * n_in
    x_base = x_ptr + (first // rows_per_group) * n_in
    acc = tl.zeros([BLOCK_R, N_PAD], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        for j in tl.static_range(BLOCK_K // SUB_K):
            cols = k0 + j * SUB_K + tl.arange(0, SUB_K)
            cmask = cols < k_hi
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            if SCALED:
                xt = _scaled_activations(
                    x_base, x_stride, cols, cmask, n_tokens, DOT_DTYPE, SUB_K, N_PAD, N_LOAD, X_SCALE
                )
                s = _scale(s_ptr, rows, rmask, first, k0 + j * SUB_K, s_cols, SB_R, SB_C, SB_R % BLOCK_R != 0)
                acc += tl.dot(w.to(DOT_DTYPE), xt) * (s / X_SCALE)
            else:
                xt = tl.load(
                    x_base + tokens[None, :] * x_stride + cols[:, None],
                    mask=cmask[:, None] & tmask[None, :],
                    other=0.0,
                )
                acc = tl.dot(w.to(DOT_DTYPE), xt.to(DOT_DTYPE), acc)
    _store(
        out_ptr,
        acc,
        tokens[None, :] * n_rows + rows[:, None],
        rmask[:, None] & tmask[None, :],
        split,
        n_tokens,
        n_rows,
        PARTIAL,
    )


@triton.jit
def _first_step(
    w,
    s,
    first,
    rows,
    n_in,
    s_cols,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # A vector tile's first step: its weight tile and their scales.
    return (
        weight_tile(w, rows, 0, n_in, QUANT, BLOCK_K),
        step_scales(scale_row(s, first, s_cols, QUANT, SB_R), rows, 0, s_cols, QUANT, SB_C, VEC, BLOCK_K),
    )


@triton.jit(do_not_specialize=["rows_per_group", "s_cols"])
def _gemv_vec_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_in,
    k_per_split,
    rows_per_group,
    s_cols,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    EARLY: tl.constexpr,
    PARTIAL: tl.constexpr,
    PDL: tl.constexpr,
):
    _vec_program(
        tl.program_id(0),
        tl.program_id(1),
        x_ptr,
        w_ptr,
        s_ptr,
        out_ptr,
        n_rows,
        n_in,
        k_per_split,
        rows_per_group,
        s_cols,
        QUANT,
        SB_R,
        SB_C,
        VEC,
        BLOCK_R,
        BLOCK_K,
        STAGES,
        EARLY,
        PARTIAL,
        PDL,
    )


@triton.jit(do_not_specialize=["s_cols_a", "s_cols_b"])
def _gemv_vec_pair_kernel(
    x_ptr,
    n_in,
    programs_a,
    wa_ptr,
    sa_ptr,
    outa_ptr,
    rows_a,
    s_cols_a,
    wb_ptr,
    sb_ptr,
    outb_ptr,
    rows_b,
    s_cols_b,
    A_QUANT: tl.constexpr,
    A_SB_R: tl.constexpr,
    A_SB_C: tl.constexpr,
    A_VEC: tl.constexpr,
    A_BLOCK_R: tl.constexpr,
    A_BLOCK_K: tl.constexpr,
    A_STAGES: tl.constexpr,
    A_EARLY: tl.constexpr,
    B_QUANT: tl.constexpr,
    B_SB_R: tl.constexpr,
    B_SB_C: tl.constexpr,
    B_VEC: tl.constexpr,
    B_BLOCK_R: tl.constexpr,
    B_BLOCK_K: tl.constexpr,
    B_STAGES: tl.constexpr,
    B_EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    # gemv_pair on vector tiles: the first programs_a programs are product a's, the rest product b's.
    pid = tl.program_id(0)
    if pid < programs_a:
        _vec_program(
            pid,
            0,
            x_ptr,
            wa_ptr,
            sa_ptr,
            outa_ptr,
            rows_a,
            n_in,
            n_in,
            rows_a,
            s_cols_a,
            A_QUANT,
            A_SB_R,
            A_SB_C,
            A_VEC,
            A_BLOCK_R,
            A_BLOCK_K,
            A_STAGES,
            A_EARLY,
            False,
            PDL,
        )
    else:
        _vec_program(
            pid - programs_a,
            0,
            x_ptr,
            wb_ptr,
            sb_ptr,
            outb_ptr,
            rows_b,
            n_in,
            n_in,
            rows_b,
            s_cols_b,
            B_QUANT,
            B_SB_R,
            B_SB_C,
            B_VEC,
            B_BLOCK_R,
            B_BLOCK_K,
            B_STAGES,
            B_EARLY,
            False,
            PDL,
        )


@triton.jit
def _vec_program(
    pid,
    split,
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    n_rows,
    n_in,
    k_per_split,
    rows_per_group,
    s_cols,
    QUANT: tl.constexpr,
    SB_R: tl.constexpr,
    SB_C: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    EARLY: tl.constexpr,
    PARTIAL: tl.constexpr,
    PDL: tl.constexpr,
):
    # One token: program (pid, split) computes rows [first, first + BLOCK_R) over its slice of the input,
    # whose start is a multiple of the scale block's columns (config_problem), so the slice's scales are
    # columns [k_lo / SB_C, ...) of the program's scale row. The first step is peeled: with EARLY its weights
    # (and scales) are read before the PDL wait, their latency overlapping the kernel before.
    first = pid * BLOCK_R
    k_lo = split * k_per_split
    rows = first + tl.arange(0, BLOCK_R)
    w = w_ptr + k_lo
    s = s_ptr + k_lo // SB_C
    if EARLY:
        w_first, s_first = _first_step(w, s, first, rows, n_in, s_cols, QUANT, SB_R, SB_C, VEC, BLOCK_K)
    pdl.start(PDL)
    if not EARLY:
        w_first, s_first = _first_step(w, s, first, rows, n_in, s_cols, QUANT, SB_R, SB_C, VEC, BLOCK_K)
    x = x_ptr + (first // rows_per_group) * n_in + k_lo
    acc = accumulate(
        tl.zeros([BLOCK_R, BLOCK_K // VEC], dtype=tl.float32),
        w_first,
        s_first,
        activations(x, rows, 0, QUANT, BLOCK_K, 1.0),
        QUANT,
        VEC,
        BLOCK_K,
    )
    y = rows_dot(
        x,
        w,
        s,
        first,
        BLOCK_K,
        tl.minimum(k_per_split, n_in - k_lo),
        n_in,
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
    _store(out_ptr, y, rows, rows < n_rows, split, 1, n_rows, PARTIAL)


@triton.jit(do_not_specialize=["n_split"])
def _sum_splits_kernel(part_ptr, out_ptr, n, n_split, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    acc = tl.load(part_ptr + i, mask=m, other=0.0)
    for s in range(1, n_split):
        acc += tl.load(part_ptr + s * n + i, mask=m, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


def weight_kind(x_dtype: torch.dtype, weight_dtype: torch.dtype, scaled: bool) -> str:
    """``"fp8"`` / ``"bf16"``: those weights times bf16 activations (tensor cores allowed);
    ``"fp32"`` for anything else (fp32 activations or weights: CUDA cores, fp32 products)."""
    if x_dtype == torch.bfloat16 and (scaled or weight_dtype == torch.bfloat16):
        return "fp8" if scaled else "bf16"
    return "fp32"


def table_key(
    kind: str, n_rows: int, n_in: int, n_tokens: int, groups: int
) -> tuple[str, int, int, int, int]:
    """The :data:`TABLE` key: the sweep times one token and four (2..8 share the four-token entry)."""
    return kind, n_rows, n_in, 1 if n_tokens == 1 else 4, groups


def config_problem(
    cfg: GemvConfig,
    kind: str,
    n_rows: int,
    n_in: int,
    n_tokens: int,
    groups: int,
    block: tuple[int, int] | None,
) -> str | None:
    """Why ``cfg`` cannot run this product, or None when it can (``block``: FP8 scale block, None if dense)."""
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_r, cfg.block_k))
    if not pow2 or cfg.split < 1:
        return f"{cfg}: block_r and block_k must be powers of two, split >= 1"
    if n_rows % groups or (groups > 1 and (n_rows // groups) % cfg.block_r):
        return f"{cfg}: {cfg.block_r}-row tiles must divide the rows per group ({n_rows} / {groups})"
    if block is not None and block[1] % cfg.block_k and cfg.block_k % block[1]:
        return f"{cfg}: block_k must divide the scale block's columns or be a multiple of them ({block})"
    if cfg.vec:
        return _vec_problem(cfg, n_rows, n_in, n_tokens, block)
    if cfg.early:
        return f"{cfg}: only vector tiles read weights before the PDL wait"
    if cfg.dot:
        if kind == "fp32" or n_tokens > DOT_ROWS:
            return f"{cfg}: tensor cores need bf16 activations and at most {DOT_ROWS} rows"
        if min(cfg.block_r, cfg.block_k, block[1] if block is not None else 16) < 16:
            return f"{cfg}: tensor-core tiles (and scale blocks) are at least 16 wide"
    elif block is not None and block[0] % cfg.block_r:
        return f"{cfg}: {cfg.block_r}-row tiles must divide the scale block's rows ({block})"
    return None


def _vec_problem(
    cfg: GemvConfig, n_rows: int, n_in: int, n_tokens: int, block: tuple[int, int] | None
) -> str | None:
    """Why the vector tile ``cfg`` cannot run this product, or None: no load is masked, and a step holds whole
    16-byte vectors of FP8 (scaled) or bf16 weights (fp32 weights' vectors are shorter)."""
    if cfg.dot or n_tokens != 1:
        return f"{cfg}: vector tiles take one token on CUDA cores"
    if n_rows % cfg.block_r or n_in % cfg.block_k or cfg.block_k * (1 if block is not None else 2) < 16:
        return f"{cfg}: vector tiles must divide the matrix ({n_rows}x{n_in}) and hold 16-byte vectors a step"
    if block is not None and (block[0] % cfg.block_r or (cfg.split > 1 and _slice_len(n_in, cfg) % block[1])):
        return f"{cfg}: a vector tile's rows and its input slices' starts must lie on scale blocks ({block})"
    return None


def _slice_len(n_in: int, cfg: GemvConfig) -> int:
    """Inputs a split-K slice reads: whole steps; the last slice may be shorter."""
    return triton.cdiv(triton.cdiv(n_in, cfg.split), cfg.block_k) * cfg.block_k


TABLED_TOKENS = 8  # the table's four-token entries serve up to this many tokens


def default_config(
    kind: str, n_rows: int, n_in: int, n_tokens: int, groups: int = 1, block: tuple[int, int] | None = None
) -> GemvConfig:
    """The swept :data:`TABLE` entry for this product, else a heuristic guess (``kind``: :func:`weight_kind`),
    decided once per shape.

    Past ``TABLED_TOKENS`` tokens only a tensor-core entry is taken: its tile pads the tokens to
    ``DOT_ROWS`` anyway, where a CUDA-core tile's accumulator grows with every token."""
    return _default_config(kind, n_rows, n_in, n_tokens, groups, None if block is None else tuple(block))


@functools.cache
def _default_config(
    kind: str, n_rows: int, n_in: int, n_tokens: int, groups: int, block: tuple[int, int] | None
) -> GemvConfig:
    if kind == "bf16" or (kind == "fp8" and block == TABLED_BLOCK):
        hit = TABLE.get(table_key(kind, n_rows, n_in, n_tokens, groups))
        if (
            hit is not None
            and (hit.dot or n_tokens <= TABLED_TOKENS)
            and config_problem(hit, kind, n_rows, n_in, n_tokens, groups, block) is None
        ):
            return hit
    return _heuristic(kind, n_rows, n_in, n_tokens, groups, block)


def split_for(programs: int, n_in: int, block_k: int, target: int = 2 * SMS, min_steps: int = 4) -> int:
    """The smallest power-of-two split giving ``target`` programs, keeping ``min_steps`` steps per slice."""
    split = 1
    while programs * split < target and n_in // (2 * split) >= min_steps * block_k:
        split *= 2
    return split


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two up to ``cap`` dividing ``n``."""
    block = cap
    while n % block:
        block //= 2
    return block


def _heuristic(
    kind: str, n_rows: int, n_in: int, n_tokens: int, groups: int, block: tuple[int, int] | None
) -> GemvConfig:
    per_group = n_rows // groups if groups > 1 else 0  # 0: any tile height divides it
    if kind != "fp32" and n_tokens <= DOT_ROWS:
        block_r = min(_pow2_divisor(per_group, 64), 64 if n_rows >= 2048 else 32 if n_rows >= 256 else 16)
        cfg = GemvConfig(block_r, _block_k(128, block), warps=block_r // 16, stages=4, dot=True)
        if config_problem(cfg, kind, n_rows, n_in, n_tokens, groups, block) is None:
            return _with_split(cfg, n_rows, n_in)
    block_r = _pow2_divisor(math.gcd(block[0] if block is not None else 0, per_group), 16)
    block_k = _block_k(
        min(max(64, 512 // triton.next_power_of_2(n_tokens)), triton.next_power_of_2(n_in)), block
    )
    return _with_split(GemvConfig(block_r, block_k, warps=4, stages=4), n_rows, n_in)


def _block_k(want: int, block: tuple[int, int] | None) -> int:
    """``want``, or the largest power of two below it that fits the scale block's columns."""
    if block is None or block[1] % want == 0 or want % block[1] == 0:
        return want
    return _pow2_divisor(block[1], want)


def _with_split(cfg: GemvConfig, n_rows: int, n_in: int) -> GemvConfig:
    return dataclasses.replace(cfg, split=split_for(triton.cdiv(n_rows, cfg.block_r), n_in, cfg.block_k))


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    groups: int = 1,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [N, K]`` (or ``[N, G, K]`` with ``groups=G``) times ``weight [R, K]`` → ``[N, R]``.

    ``scale`` (with its ``block``) makes ``weight`` FP8 e4m3; ``out`` is an optional contiguous
    ``[N, R]`` destination of ``x``'s dtype. A tile with ``early`` reads ``weight`` and ``scale`` before the
    PDL wait, so they must not be the output of the launch before (the model passes its stored weights)."""
    n_rows, n_in = weight.shape
    x2 = x.reshape(-1, groups * n_in).contiguous()
    n_tokens = x2.shape[0]
    if scale is not None and (block is None or weight.dtype != torch.float8_e4m3fn):
        raise ValueError("gemv: block scales need a float8_e4m3fn weight and their block")
    if not weight.is_contiguous():
        raise ValueError("gemv: the weight must be contiguous (copying it would cost more than the product)")
    cfg, block, k_per_split, split = _plan(x2.dtype, n_tokens, weight, scale, block, groups, config)
    if out is None:
        out = torch.empty(n_tokens, n_rows, device=x.device, dtype=x.dtype)
    target = out if split == 1 else torch.empty(split, n_tokens, n_rows, device=x.device, dtype=torch.float32)
    s_cols = scale.shape[1] if scale is not None else 0
    grid = (triton.cdiv(n_rows, cfg.block_r), split)
    if cfg.vec:
        _gemv_vec_kernel[grid](
            x2,
            weight,
            weight if scale is None else scale,
            target,
            n_rows,
            n_in,
            k_per_split,
            n_rows // groups,
            s_cols,
            **_vec_consts(cfg, weight, block),
            PARTIAL=split > 1,
            num_warps=cfg.warps,
            num_stages=cfg.stages,
            **pdl.launch(x2),
        )
    else:
        args = (
            x2,
            weight,
            scale,
            target,
            n_rows,
            n_in,
            k_per_split,
            n_rows // groups,
            x2.stride(0),
            s_cols,
            n_tokens,
        )
        consts = dict(
            **_tile_consts(cfg, block),
            PARTIAL=split > 1,
            num_warps=cfg.warps,
            num_stages=cfg.stages,
            **pdl.launch(x2),
        )
        if cfg.dot:
            _gemv_dot_kernel[grid](
                *args,
                N_PAD=DOT_ROWS,
                DOT_DTYPE=_dot_dtype(x2, scale is not None),
                N_LOAD=triton.next_power_of_2(n_tokens),
                X_SCALE=FP8_X_SCALE,
                **consts,
            )
        else:
            _gemv_fma_kernel[grid](*args, N_PAD=triton.next_power_of_2(n_tokens), **consts)
    if split > 1:
        n = n_tokens * n_rows
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](
            target, out, n, split, BLOCK=1024, num_warps=4, **pdl.launch(x2)
        )
    return out


def _plan(
    x_dtype: torch.dtype,
    n_tokens: int,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    groups: int,
    config: GemvConfig | None,
) -> tuple[GemvConfig, tuple[int, int] | None, int, int]:
    """``(config, scale block or None, inputs per slice, slices)`` of a product: ``config`` or the
    table's, checked; the last slice may be shorter, and a split wider than the input has fewer slices."""
    n_rows, n_in = weight.shape
    block = block if scale is not None else None
    kind = weight_kind(x_dtype, weight.dtype, scale is not None)
    cfg = config or default_config(kind, n_rows, n_in, n_tokens, groups, block)
    problem = config_problem(cfg, kind, n_rows, n_in, n_tokens, groups, block)
    if problem:
        raise ValueError(f"gemv: {problem}")
    k_per_split = _slice_len(n_in, cfg)
    return cfg, block, k_per_split, triton.cdiv(n_in, k_per_split)


Operand = tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None]  # weight, FP8 scales, their block


def gemv_pair(x: torch.Tensor, a: Operand, b: Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemv(x, *a), gemv(x, *b))`` for two weights of one input width, each ``(weight, scale, block)``
    as :func:`gemv` takes them (e.g. a layer's FP8 input projections and its bf16 compressor weights).

    When both products' table configurations are CUDA-core tiles without split-K, or both vector tiles without
    split-K, one launch runs both (the first programs product ``a``'s, the rest product ``b``'s), so the second
    product's ramp and the gap between them are saved; otherwise two :func:`gemv` launches."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n_tokens, n_in = x2.shape
    if any(op[0].shape[1] != n_in for op in (a, b)):
        raise ValueError(
            f"gemv_pair: both weights must take {n_in} inputs, not {a[0].shape[1]} and {b[0].shape[1]}"
        )
    plans = [_pair_plan(x2, *op) for op in (a, b)]
    if any(plan is None for plan in plans) or plans[0].vec != plans[1].vec:
        return gemv(x2, *a), gemv(x2, *b)
    outs = [torch.empty(n_tokens, op[0].shape[0], device=x.device, dtype=x.dtype) for op in (a, b)]
    blocks = [block if scale is not None else None for _, scale, block in (a, b)]
    programs = [triton.cdiv(op[0].shape[0], cfg.block_r) for op, cfg in zip((a, b), plans)]
    (wa, sa, _), (wb, sb, _) = a, b
    launch = dict(
        num_warps=max(cfg.warps for cfg in plans),
        num_stages=max(cfg.stages for cfg in plans),
        **pdl.launch(x2),
    )
    if plans[0].vec:
        consts = {
            f"{prefix}_{name}": value
            for prefix, (w, _, _), cfg, block in zip("AB", (a, b), plans, blocks)
            for name, value in _vec_consts(cfg, w, block).items()
        }
        _gemv_vec_pair_kernel[(sum(programs),)](
            x2,
            n_in,
            programs[0],
            wa,
            wa if sa is None else sa,
            outs[0],
            wa.shape[0],
            sa.shape[1] if sa is not None else 0,
            wb,
            wb if sb is None else sb,
            outs[1],
            wb.shape[0],
            sb.shape[1] if sb is not None else 0,
            **consts,
            **launch,
        )
        return outs[0], outs[1]
    consts = {
        f"{prefix}_{name}": value
        for prefix, cfg, block in zip("AB", plans, blocks)
        for name, value in _tile_consts(cfg, block).items()
    }
    _gemv_fma_pair_kernel[(sum(programs),)](
        x2,
        x2.stride(0),
        n_in,
        n_tokens,
        programs[0],
        wa,
        sa,
        outs[0],
        wa.shape[0],
        sa.shape[1] if sa is not None else 0,
        wb,
        sb,
        outs[1],
        wb.shape[0],
        sb.shape[1] if sb is not None else 0,
        N_PAD=triton.next_power_of_2(n_tokens),
        **consts,
        **launch,
    )
    return outs[0], outs[1]


def _vec_consts(cfg: GemvConfig, weight: torch.Tensor, block: tuple[int, int] | None) -> dict:
    """A vector-tile program's compile-time parameters for ``cfg``, ``weight`` and its FP8 scale ``block``
    (None: dense)."""
    sb_r, sb_c = block or (1, 1)
    return dict(
        QUANT=DENSE if block is None else FP8,
        SB_R=sb_r,
        SB_C=sb_c,
        VEC=16 // weight.element_size(),
        BLOCK_R=cfg.block_r,
        BLOCK_K=cfg.block_k,
        STAGES=cfg.stages,
        EARLY=cfg.early,
    )


def _tile_consts(cfg: GemvConfig, block: tuple[int, int] | None) -> dict:
    """A GEMV program's compile-time tile parameters for ``cfg`` and the FP8 scale ``block`` (None: dense)."""
    sb_r, sb_c = block or (1, 1)
    return dict(
        SCALED=block is not None,
        SB_R=sb_r,
        SB_C=sb_c,
        BLOCK_R=cfg.block_r,
        BLOCK_K=cfg.block_k,
        SUB_K=min(cfg.block_k, sb_c) if block is not None else cfg.block_k,
        STAGES=cfg.stages,
    )


def _pair_plan(
    x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None
) -> GemvConfig | None:
    """``weight``'s configuration when it can run inside a pair kernel (CUDA-core or vector tiles, no split-K,
    contiguous), else None."""
    if not weight.is_contiguous() or (scale is not None and weight.dtype != torch.float8_e4m3fn):
        return None
    try:
        cfg, _, _, slices = _plan(x2.dtype, x2.shape[0], weight, scale, block, 1, None)
    except ValueError:  # a table entry this product cannot run: gemv says why
        return None
    return None if cfg.dot or slices > 1 else cfg


def _dot_dtype(x: torch.Tensor, scaled: bool) -> tl.dtype:
    """The operands' type: bf16 (dense) or fp16 (FP8 weights) on the GPU; fp32 for CPU tensors (Triton's
    interpreter, whose tl.dot multiplies the bit patterns of bf16, stored as uint16, as integers)."""
    if not x.is_cuda:
        return tl.float32
    return tl.float16 if scaled else tl.bfloat16


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """Torch reference in fp32: dequantise, then a (grouped) matrix product."""
    w = weight.float() if scale is None else dequant_fp8(weight, scale, block, torch.float32)
    n_rows, n_in = w.shape
    xf = x.float().reshape(-1, groups, n_in)
    y = torch.einsum("ngk,grk->ngr", xf, w.view(groups, n_rows // groups, n_in))
    return y.reshape(-1, n_rows).to(x.dtype)
