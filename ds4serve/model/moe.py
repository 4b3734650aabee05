"""Mixture of experts: sqrt-softplus router (bias for selection only) or hash routing, clamped
SwiGLU routed experts weighted after the down projection, plus one always-on shared expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [E, D] router
    bias: torch.Tensor | None  # [E] fp32 selection bias (non-hash layers)
    tid2eid: torch.Tensor | None  # [V, k] int64 (hash layers)
    w1: torch.Tensor  # [E, I, D] gate
    w3: torch.Tensor  # [E, I, D] up
    w2: torch.Tensor  # [E, D, I] down
    shared_w1: torch.Tensor  # [I, D]
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor  # [D, I]


def route(w: MoEWeights, x: torch.Tensor, token_ids: torch.Tensor, top_k: int, scaling: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k], expert ids [N, k])`` for tokens ``x [N, D]``."""
    scores = F.softplus(F.linear(x, w.gate)).sqrt()
    if w.tid2eid is not None:
        idx = w.tid2eid[token_ids]
    else:
        idx = torch.topk(scores + w.bias, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, idx)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, idx


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """``w2 (silu(clamp(w1 x, max=limit)) * clamp(w3 x, -limit, limit))``."""
    g = F.linear(x, w1)
    u = F.linear(x, w3)
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return F.linear(F.silu(g) * u, w2)


def moe(w: MoEWeights, x: torch.Tensor, token_ids: torch.Tensor, top_k: int, scaling: float,
        limit: float) -> torch.Tensor:
    """Routed experts (only the selected ones are read) plus the shared expert."""
    weights, idx = route(w, x, token_ids, top_k, scaling)
    out = torch.zeros_like(x)
    for expert in torch.unique(idx).tolist():
        token, slot = torch.where(idx == expert)
        y = swiglu(x[token], w.w1[expert], w.w3[expert], w.w2[expert], limit) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out + swiglu(x, w.shared_w1, w.shared_w3, w.shared_w2, limit)
