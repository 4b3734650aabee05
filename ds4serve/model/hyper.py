"""Manifold-constrained hyper-connections (mHC): the 4-stream residual of DeepSeek-V4.

The residual ``X`` is ``[S, hc, D]``. Each site (before attention, before the MoE) computes
``pre``, ``post`` and a Sinkhorn-normalised ``comb`` from ``X`` in fp32; ``pre`` collapses the
streams into the sublayer input and ``post``/``comb`` expand the sublayer output back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels.regions import region
from .norms import rms_norm, unweighted_rms_norm


@dataclass
class HCSite:
    fn: torch.Tensor  # [(2+hc)*hc, hc*D] fp32
    base: torch.Tensor  # [(2+hc)*hc] fp32
    scale: torch.Tensor  # [3] fp32


def hc_split(
    X: torch.Tensor, site: HCSite, hc: int, iters: int, eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse ``X`` for the sublayer; return ``(post [S,hc], comb [S,hc,hc], collapsed [S,D])``.

    The Sinkhorn iterations stay outside the compiled regions: Inductor would give each of their
    40 alternating reductions its own kernel, where the Triton kernel keeps them in registers.
    """
    if _mix_kernel(X):
        from ..kernels.hc_streams import hc_mixes

        mixes = hc_mixes(X, site.fn, norm_eps)
    else:
        mixes = _hc_mixes(X, site.fn, norm_eps)
    if not kernels.enabled(mixes):
        coefficients = hc_coefficients
    elif torch.compiler.is_compiling():  # traced as an op of the compiled region
        from ..kernels.ops import hc_coefficients as coefficients
    else:  # the kernel itself: the custom op's dispatch costs an eager chunk's host more than the launch
        from ..kernels.hyper import hc_coefficients as coefficients
    pre, post, comb = coefficients(mixes, site.base.float(), site.scale.float(), hc, iters, eps)
    return post, comb, _collapse(pre, X)


def hc_pre(
    X: torch.Tensor, site: HCSite, norm_w: torch.Tensor, hc: int, iters: int, eps: float, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole pre site: ``(post [S,hc], comb [S,hc,hc], x_in [S,D])``, ``x_in`` the collapsed streams
    through the sublayer's input norm ``rms_norm(., norm_w, norm_eps)``.

    A decode-sized chunk on the kernels' devices is one launch (:mod:`ds4serve.kernels.hc_pre`);
    otherwise :func:`hc_split` and :func:`~ds4serve.model.norms.rms_norm`, the reference.
    """
    if fused_sites(X):
        from ..kernels.ops import hc_pre as fused

        return fused(X, site.fn, site.base, site.scale, norm_w, hc, iters, eps, norm_eps)
    post, comb, y = hc_split(X, site, hc, iters, eps, norm_eps)
    return post, comb, rms_norm(y, norm_w, norm_eps)


def hc_merge_pre(
    X: torch.Tensor,
    out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    site: HCSite,
    norm_w: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's merge then the next pre site: ``(X', post', comb', x_in)`` for
    ``X' = hc_merge(X, out, post, comb)`` and ``hc_pre(X', site, norm_w, ...)``.

    ``out`` is ``[S, D]``, or the fused MoE's fp32 slot terms ``[S, slots, D]`` (their sum is the output,
    :func:`sum_terms`). A decode-sized chunk on the kernels' devices is one launch
    (:mod:`ds4serve.kernels.hc_pre`), whose merge rounds as the product-sum branch of :func:`hc_merge` does;
    otherwise the two functions.
    """
    if fused_sites(X):
        from ..kernels.ops import hc_merge_pre as fused

        return fused(X, out, post, comb, site.fn, site.base, site.scale, norm_w, hc, iters, eps, norm_eps)
    if out.dim() == 3:
        out = sum_terms(out, X.dtype)
    X = hc_merge(X, out, post, comb)
    return X, *hc_pre(X, site, norm_w, hc, iters, eps, norm_eps)


def sum_terms(terms: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sublayer output from its fp32 terms ``[S, terms, D]`` (the fused MoE's slot terms): summed in term order
    in fp32, then cast to ``dtype``, as the MoE's slot-sum launch that the unsummed terms save does and as the
    fused merge does (:mod:`ds4serve.kernels.hc_pre`)."""
    acc = terms[:, 0]
    for j in range(1, terms.shape[1]):
        acc = acc + terms[:, j]
    return acc.to(dtype)


def fused_sites(X: torch.Tensor) -> bool:
    """Whether a pre site on the streams ``X`` is the one-launch kernel (decode-sized or a verify block), with or
    without the merge before it."""
    if not kernels.enabled(X):
        return False
    from ..kernels.hc_pre import MAX_ROWS

    return X.shape[0] <= MAX_ROWS


MIX_REDUCE_MAX_ROWS = 8  # up to this many rows the mixes are a product-sum (fused), else a matmul


@region(chunks=True)
def _hc_mixes(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fp32 mixes ``[S, (2+hc)*hc]`` of the normalised flattened streams.

    For decode-sized chunks the product is written as a broadcast multiply and sum: in a compiled
    region Inductor fuses it with the norm into one reduction, where a matmul of 24 output columns
    would be a cuBLAS dot kernel plus a reduce kernel per site.
    """
    flat = unweighted_rms_norm(X.flatten(-2).float(), norm_eps)
    if flat.shape[0] <= MIX_REDUCE_MAX_ROWS:
        return (flat.unsqueeze(-2) * fn.float()).sum(-1)
    return F.linear(flat, fn.float())


def _mix_kernel(X: torch.Tensor) -> bool:
    """A long chunk's mixes through :func:`ds4serve.kernels.hc_streams.hc_mixes`."""
    if not _stream_kernels(X):
        return False
    from ..kernels.hc_streams import mixes_apply

    return mixes_apply(X)


def _stream_kernels(X: torch.Tensor) -> bool:
    """Chunks of more than ``MIX_REDUCE_MAX_ROWS`` rows run eagerly use :mod:`ds4serve.kernels.hc_streams`. A
    decode step's products, and a wider verify block's inside a compiled region, stay torch code, which
    Inductor fuses with their neighbours: Inductor compiles a raw Triton kernel from its source in a worker
    process, where the ``pdl`` helpers those kernels call are not defined."""
    return X.shape[0] > MIX_REDUCE_MAX_ROWS and kernels.enabled(X) and not torch.compiler.is_compiling()


@region
def _collapse(pre: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``sum_k pre_k X_k`` in fp32, cast to X's dtype."""
    if _stream_kernels(X):
        from ..kernels.hc_streams import hc_collapse

        return hc_collapse(pre, X)
    return (pre.unsqueeze(-1) * X).sum(dim=-2).to(X.dtype)


def hc_coefficients(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre, post, comb)`` from the fp32 mixes ``[S, (2+hc)*hc]``: sigmoids and Sinkhorn."""
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(*comb_w.shape[:-1], hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


@region
def hc_merge(X: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``X'_k = post_k * out + sum_j comb[j, k] X_j`` with post/comb rounded to X's dtype."""
    if _stream_kernels(X):
        from ..kernels.hc_streams import hc_merge as merge

        return merge(X, out, post, comb)
    dtype = X.dtype
    mix_t = comb.to(dtype).transpose(-1, -2)
    if X.shape[0] <= MIX_REDUCE_MAX_ROWS:  # fp32 sums, as the matmul's
        mixed = (mix_t.float().unsqueeze(-1) * X.float().unsqueeze(-3)).sum(-2).to(dtype)
    else:
        mixed = torch.matmul(mix_t, X)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


@region
def hc_head(
    X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float
) -> torch.Tensor:
    """Final merge of the streams: sigmoid weights (no Sinkhorn), fp32 sum cast to X's dtype."""
    flat = unweighted_rms_norm(X.flatten(-2).float(), norm_eps)
    mixes = F.linear(flat, fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * X).sum(dim=-2).to(X.dtype)
