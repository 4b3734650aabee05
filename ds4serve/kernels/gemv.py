"""FP8 block-scaled GEMV for a few activation rows (decode): ``y = x W^T`` with W read as FP8.

``W [R, K]`` is float8 e4m3 with fp32 block scales ``[ceil(R/b0), ceil(K/b1)]``; it is dequantised
in registers, so each weight byte is read once per call. ``groups > 1`` is the grouped low-rank
output projection of DeepSeek-V4: output rows ``[g R/G, (g+1) R/G)`` read input group ``g`` of
``x [N, G, K]``. :func:`fp8_gemv_ref` is the torch reference.

Batch-1 decode is bound by the bytes in flight: a projection with few output rows and a long
input (``wo_b``: 4096 x 8192) gives too few programs to keep every SM streaming. With split-K
(:class:`GemvConfig` ``split > 1``) each program reads one slice of the input, writes an fp32
partial, and a second launch sums the slices in a fixed order (deterministic, unlike atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..quant import dequant_fp8
from .switches import SWITCHES

TARGET_PROGRAMS = 1024  # split-K aims for at least this many programs (~8 per SM on an H200)


@dataclass(frozen=True)
class GemvConfig:
    block_r: int  # output rows per program (divides the scale block's rows)
    block_k: int  # input columns per loop step
    split: int = 1  # slices of the input, one program each; summed by a second launch
    warps: int = 8
    stages: int = 3


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, n_rows, n_in, k_per_split, rows_per_group, x_stride, s_cols,
                     n_tokens, SB_R: tl.constexpr, SB_C: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr):
    # A program's rows lie in one scale row (SB_R % BLOCK_R == 0), so the block scales multiply the
    # activation vector (BLOCK_K products) rather than every weight of the tile.
    first = tl.program_id(0) * BLOCK_R
    token = tl.program_id(1)
    split = tl.program_id(2)
    rows = first + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    x = x_ptr + token * x_stride + (first // rows_per_group) * n_in
    s_row = s_ptr + (first // SB_R) * s_cols
    w_rows = w_ptr + rows[:, None].to(tl.int64) * n_in
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, n_in)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < k_hi
        w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        xs = tl.load(x + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(s_row + cols // SB_C, mask=cmask,
                                                                                 other=0.0)
        acc += w * xs[None, :]
    y = tl.sum(acc, axis=1)
    if PARTIAL:
        tl.store(out_ptr + (split * n_tokens + token) * n_rows + rows, y, mask=rmask)
    else:
        tl.store(out_ptr + token * n_rows + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, n, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    acc = tl.load(part_ptr + i, mask=m, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(part_ptr + s * n + i, mask=m, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


def rows_per_program(scale_rows: int, cap: int = 16) -> int:
    """The largest power of two up to ``cap`` dividing the scale block's rows."""
    block = cap
    while scale_rows % block:
        block //= 2
    return block


def default_config(n_rows: int, n_in: int, n_tokens: int, block: tuple[int, int]) -> GemvConfig:
    """The previous round's fixed shape, or (``SWITCHES.gemv_split``) wider tiles plus split-K."""
    block_k = min(512, triton.next_power_of_2(max(n_in, 16)))
    if not SWITCHES.gemv_split:
        return GemvConfig(rows_per_program(block[0]), block_k)
    block_r = rows_per_program(block[0])
    programs = triton.cdiv(n_rows, block_r) * n_tokens
    split = 1
    while programs * split < TARGET_PROGRAMS and n_in // (2 * split) >= block_k:
        split *= 2
    return GemvConfig(block_r, block_k, split, warps=4, stages=4)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             groups: int = 1, config: GemvConfig | None = None) -> torch.Tensor:
    """``x [N, K]`` (or ``[N, G, K]`` with ``groups=G``) times FP8 ``weight [R, K]`` → ``[N, R]``."""
    n_rows, n_in = weight.shape
    x2 = x.reshape(-1, groups * n_in).contiguous()
    N = x2.shape[0]
    rows_per_group = n_rows // groups
    cfg = config or default_config(n_rows, n_in, N, block)
    if block[0] % cfg.block_r or rows_per_group % cfg.block_r:
        raise ValueError(f"fp8_gemv: {cfg.block_r}-row tiles must divide the scale block ({block[0]}) "
                         f"and the rows per group ({rows_per_group})")
    out = torch.empty(N, n_rows, device=x.device, dtype=x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(n_in, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(n_in, k_per_split)
    target = out if split == 1 else torch.empty(split, N, n_rows, device=x.device, dtype=torch.float32)
    _fp8_gemv_kernel[(triton.cdiv(n_rows, cfg.block_r), N, split)](
        x2, weight, scale, target, n_rows, n_in, k_per_split, rows_per_group, x2.stride(0), scale.shape[1], N,
        SB_R=block[0], SB_C=block[1], BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, PARTIAL=split > 1,
        num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1:
        n = N * n_rows
        _sum_splits_kernel[(triton.cdiv(n, 1024),)](target, out, n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 groups: int = 1) -> torch.Tensor:
    """Torch reference in fp32: dequantise, then a (grouped) matrix product."""
    w = dequant_fp8(weight, scale, block, torch.float32)
    n_rows, n_in = w.shape
    xf = x.float().reshape(-1, groups, n_in)
    y = torch.einsum("ngk,grk->ngr", xf, w.view(groups, n_rows // groups, n_in))
    return y.reshape(-1, n_rows).to(x.dtype)
