"""The mHC stream products of a chunk in one pass each: collapse before a sublayer, merge after it.

For a prefill chunk the torch code spends most of an mHC site in layout work, not arithmetic: the
merge is a batch of ``S`` tiny ``[hc, hc] @ [hc, D]`` products (cuBLAS runs it as a batched GEMM of
``M = hc``) plus a broadcast, and the collapse materialises an fp32 ``[S, hc, D]`` product before
summing it. Here one program per (token, block of D) reads the token's ``hc`` stream rows once.
Rounding follows :func:`ds4serve.model.hyper.hc_merge` / ``_collapse``: the merge rounds ``post * out``
and the fp32 stream mix to the streams' dtype before adding them; the collapse sums in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

BLOCK_D = 1024
# Launch options of every kernel that calls merged(): without floating-point contraction. With it, the
# compiler turns "round post_k * out to bf16, then add the rounded mix" into one bf16 fused multiply-add,
# which skips the product's rounding (sm_90 PTX ``fma.rn.bf16``): the merge then differs from hc_merge's
# by about one bf16 rounding (relative 2.6e-3 on the H200, eleventh run).
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
def _merge_kernel(x_ptr, out_ptr, post_ptr, comb_ptr, y_ptr, D, HC: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
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
        acc += tl.load(pre_ptr + s * HC + k) * tl.load(x_ptr + (s * HC + k) * D + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(y_ptr + s * D + d, acc.to(y_ptr.dtype.element_ty), mask=dm)


def hc_merge(X: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_k = post_k * out + sum_j comb[j, k] X_j`` for streams ``X [S, hc, D]``, ``out [S, D]``,
    fp32 ``post [S, hc]`` and ``comb [S, hc, hc]``."""
    S, hc, D = X.shape
    X, out = X.contiguous(), out.to(X.dtype).contiguous()
    y = torch.empty_like(X)
    block = min(BLOCK_D, triton.next_power_of_2(D))
    _merge_kernel[(S, triton.cdiv(D, block))](X, out, post.float().contiguous(), comb.float().contiguous(), y, D,
                                               HC=hc, BLOCK=block, num_warps=4, **EXACT_ROUNDING,
                                               **pdl.launch(X))
    return y


def hc_collapse(pre: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``sum_k pre_k X_k`` in fp32, cast to X's dtype: ``[S, D]`` for fp32 ``pre [S, hc]``."""
    S, hc, D = X.shape
    X = X.contiguous()
    y = torch.empty(S, D, device=X.device, dtype=X.dtype)
    block = min(BLOCK_D, triton.next_power_of_2(D))
    _collapse_kernel[(S, triton.cdiv(D, block))](X, pre.float().contiguous(), y, D, HC=hc, BLOCK=block,
                                                  num_warps=4, **pdl.launch(X))
    return y
