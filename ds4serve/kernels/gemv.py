"""FP8 block-scaled GEMV for a few activation rows (decode): ``y = x W^T`` with W read as FP8.

``W [R, K]`` is float8 e4m3 with fp32 block scales ``[ceil(R/b0), ceil(K/b1)]``; it is dequantised
in registers, so each weight byte is read once per call. ``groups > 1`` is the grouped low-rank
output projection of DeepSeek-V4: output rows ``[g R/G, (g+1) R/G)`` read input group ``g`` of
``x [N, G, K]``. :func:`fp8_gemv_ref` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import dequant_fp8


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, n_rows, n_in, rows_per_group, x_stride, s_cols,
                     SB_R: tl.constexpr, SB_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # A program's rows lie in one scale row (SB_R % BLOCK_R == 0), so the block scales multiply the
    # activation vector (BLOCK_K products) rather than every weight of the tile.
    first = tl.program_id(0) * BLOCK_R
    token = tl.program_id(1)
    rows = first + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    x = x_ptr + token * x_stride + (first // rows_per_group) * n_in
    s_row = s_ptr + (first // SB_R) * s_cols
    w_rows = w_ptr + rows[:, None].to(tl.int64) * n_in
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < n_in
        w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        xs = tl.load(x + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(s_row + cols // SB_C, mask=cmask,
                                                                                 other=0.0)
        acc += w * xs[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + token * n_rows + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


def rows_per_program(scale_rows: int, cap: int = 16) -> int:
    """The largest power of two up to ``cap`` dividing the scale block's rows."""
    block = cap
    while scale_rows % block:
        block //= 2
    return block


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
             groups: int = 1) -> torch.Tensor:
    """``x [N, K]`` (or ``[N, G, K]`` with ``groups=G``) times FP8 ``weight [R, K]`` → ``[N, R]``."""
    n_rows, n_in = weight.shape
    x2 = x.reshape(-1, groups * n_in).contiguous()
    N = x2.shape[0]
    rows_per_group = n_rows // groups
    block_r = rows_per_program(block[0])
    if rows_per_group % block_r:
        raise ValueError(f"fp8_gemv: rows per group ({rows_per_group}) must be a multiple of {block_r}")
    out = torch.empty(N, n_rows, device=x.device, dtype=x.dtype)
    block_k = min(512, triton.next_power_of_2(max(n_in, 16)))
    _fp8_gemv_kernel[(triton.cdiv(n_rows, block_r), N)](
        x2, weight, scale, out, n_rows, n_in, rows_per_group, x2.stride(0), scale.shape[1],
        SB_R=block[0], SB_C=block[1], BLOCK_R=block_r, BLOCK_K=block_k, num_warps=8, num_stages=3)
    return out


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 groups: int = 1) -> torch.Tensor:
    """Torch reference in fp32: dequantise, then a (grouped) matrix product."""
    w = dequant_fp8(weight, scale, block, torch.float32)
    n_rows, n_in = w.shape
    xf = x.float().reshape(-1, groups, n_in)
    y = torch.einsum("ngk,grk->ngr", xf, w.view(groups, n_rows // groups, n_in))
    return y.reshape(-1, n_rows).to(x.dtype)
