"""mHC coefficients in one launch: sigmoid pre/post and the Sinkhorn-normalised comb matrix.

The torch reference (:func:`ds4serve.model.hyper.hc_coefficients` on CPU tensors) spends two
small kernels per Sinkhorn half-step, about 80 launches per site; here each program keeps the
``hc x hc`` matrices of a block of :data:`TOKENS` tokens in registers for all iterations. A token's
values do not depend on the block it shares: every reduction is over its own matrix.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

TOKENS = 64  # tokens per program of hc_coefficients


@triton.jit
def pre_coefficients(pre_w, base_ptr, scale_ptr, eps, HC: tl.constexpr):
    """``pre [HC]`` of :func:`coefficients` alone (for a program that collapses the streams and needs no more)."""
    return tl.sigmoid(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + tl.arange(0, HC))) + eps


@triton.jit
def coefficients(pre_w, post_w, comb_w, base_ptr, scale_ptr, iters, eps, HC: tl.constexpr):
    """``(pre [..., HC], post [..., HC], comb [..., HC, HC])`` from fp32 mixes split as ``pre_w [..., HC]``,
    ``post_w [..., HC]``, ``comb_w [..., HC, HC]`` (one token, or a block of tokens on a leading axis): the
    sigmoids and the Sinkhorn iterations in registers."""
    j = tl.arange(0, HC)
    cell = j[:, None] * HC + j[None, :]
    pre = pre_coefficients(pre_w, base_ptr, scale_ptr, eps, HC)
    post = 2.0 * tl.sigmoid(post_w * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + j))
    c = comb_w * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + cell)
    c = tl.exp(c - tl.expand_dims(tl.max(c, axis=-1), -1))
    c = c / tl.expand_dims(tl.sum(c, axis=-1), -1) + eps
    c = c / (tl.expand_dims(tl.sum(c, axis=-2), -2) + eps)
    for _ in range(iters - 1):
        c = c / (tl.expand_dims(tl.sum(c, axis=-1), -1) + eps)
        c = c / (tl.expand_dims(tl.sum(c, axis=-2), -2) + eps)
    return pre, post, c


@triton.jit
def _hc_coeff_kernel(
    mix_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    S,
    iters,
    eps,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tm = t < S
    n_mix: tl.constexpr = (2 + HC) * HC
    j = tl.arange(0, HC)
    cell = (j[:, None] * HC + j[None, :])[None, :, :]
    row = mix_ptr + t[:, None] * n_mix  # [BLOCK, 1]
    pre, post, comb = coefficients(
        tl.load(row + j[None, :], mask=tm[:, None], other=0.0),
        tl.load(row + HC + j[None, :], mask=tm[:, None], other=0.0),
        tl.load(row[:, :, None] + 2 * HC + cell, mask=tm[:, None, None], other=0.0),
        base_ptr,
        scale_ptr,
        iters,
        eps,
        HC,
    )
    tl.store(pre_ptr + t[:, None] * HC + j[None, :], pre, mask=tm[:, None])
    tl.store(post_ptr + t[:, None] * HC + j[None, :], post, mask=tm[:, None])
    tl.store(comb_ptr + t[:, None, None] * (HC * HC) + cell, comb, mask=tm[:, None, None])


def hc_coefficients(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [S,hc], post [S,hc], comb [S,hc,hc])`` from fp32 ``mixes [S, (2+hc)*hc]``."""
    S = mixes.shape[0]
    mixes = mixes.contiguous()
    pre = torch.empty(S, hc, device=mixes.device, dtype=torch.float32)
    post = torch.empty_like(pre)
    comb = torch.empty(S, hc, hc, device=mixes.device, dtype=torch.float32)
    _hc_coeff_kernel[(triton.cdiv(S, TOKENS),)](
        mixes,
        base,
        scale,
        pre,
        post,
        comb,
        S,
        iters,
        eps,
        HC=hc,
        BLOCK=TOKENS,
        num_warps=4,
        **pdl.launch(mixes),
    )
    return pre, post, comb
