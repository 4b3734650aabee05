"""RMSNorm variants, with transformers' precision: statistics in fp32, one cast back."""

from __future__ import annotations

import torch

from ..kernels.regions import region


@region(chunks=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm; ``weight`` is kept in fp32 and the product is cast once to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


@region(chunks=True)
def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm (per-head q, mHC input): fp32 statistics, the factor cast to x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
