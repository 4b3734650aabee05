"""Torch functions that the model runs and the kernels' references share (torch only, no Triton)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

RANK_MAX_ROWS = 64  # up to this many rows, top-k by pairwise ranks (decode, verify); else torch.topk


def swiglu_gate(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(clamp(g, max=limit)) * clamp(u, -limit, limit)`` (no clamp when ``limit <= 0``)."""
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values of each row of ``x [N, E]`` (best first; ties: lower index).

    For a few rows the ranks come from pairwise comparisons (``[N, E, E]``): plain elementwise work
    that a compiled decode region fuses into the router's kernel, where ``torch.topk`` would launch
    a sort of its own per layer. Any NaN still yields indices in range.
    """
    if x.shape[0] > RANK_MAX_ROWS:
        return torch.topk(x, k, dim=-1).indices
    E = x.shape[-1]
    e = torch.arange(E, device=x.device)
    mine, other = x.unsqueeze(-1), x.unsqueeze(-2)
    above = (other > mine) | ((other == mine) & (e < e.unsqueeze(-1)))  # [N, me, other]: other ranks above me
    rank = above.sum(-1)
    slot = torch.arange(k, device=x.device).view(1, k, 1)
    return torch.where(rank.unsqueeze(1) == slot, e, E).amin(-1).clamp(max=E - 1)
