"""Mixture of experts: sqrt-softplus router (bias for selection only) or hash routing, clamped
SwiGLU routed experts weighted after the down projection, plus one always-on shared expert."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels.reference import swiglu_gate, top_k_indices
from ..kernels.regions import region
from ..quant import FP8Weight, Weight
from .linear import linear
from .moe_grouped import routed_experts


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [E, D] router
    bias: torch.Tensor | None  # [E] fp32 selection bias (non-hash layers)
    tid2eid: torch.Tensor | None  # [V, k] int64 (hash layers)
    w1: Weight  # [E, I, D] gate
    w3: Weight  # [E, I, D] up
    w2: Weight  # [E, D, I] down
    shared_w1: Weight  # [I, D]
    shared_w3: Weight
    shared_w2: Weight  # [D, I]


@region
def route(
    w: MoEWeights, x: torch.Tensor, token_ids: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k], expert ids [N, k])`` for tokens ``x [N, D]``."""
    if _router_fused_applies(w, x):
        from ..kernels import ops

        return ops.route_decode(x, w.gate, w.bias, w.tid2eid, token_ids, top_k, scaling)
    scores = F.softplus(linear(x, w.gate)).sqrt()
    if w.tid2eid is not None:
        idx = w.tid2eid[token_ids]
    else:
        idx = top_k_indices(scores + w.bias, top_k)
    weights = scores.gather(1, idx)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, idx


def _router_fused_applies(w: MoEWeights, x: torch.Tensor) -> bool:
    """The one-launch router takes a few rows (decode: up to ``kernels.router.MAX_ROWS``) of bf16 / fp32 tokens
    with a dense contiguous gate."""
    if not kernels.enabled(x):
        return False
    from ..kernels.router import MAX_ROWS

    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float32)
        and isinstance(w.gate, torch.Tensor)
        and w.gate.dim() == 2
        and w.gate.is_contiguous()
    )


def swiglu(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight, limit: float) -> torch.Tensor:
    """``w2 (silu(clamp(w1 x, max=limit)) * clamp(w3 x, -limit, limit))``."""
    return linear(swiglu_gate(linear(x, w1), linear(x, w3), limit), w2)


def moe(
    w: MoEWeights,
    x: torch.Tensor,
    token_ids: torch.Tensor,
    top_k: int,
    scaling: float,
    limit: float,
    slot_terms: bool = False,
) -> torch.Tensor:
    """Routed experts (only the selected ones are read) plus the shared expert. ``slot_terms``: where the
    fused decode kernels run, their fp32 terms ``[S, top_k + 1, D]`` unsummed (for a consumer that sums
    them in its own launch, :func:`ds4serve.model.hyper.sum_terms` being that sum); elsewhere the sum."""
    weights, idx = route(w, x, token_ids, top_k, scaling)
    if _fused_applies(x, idx):
        return _moe_fused(w, x, idx, weights, limit, not slot_terms)
    return routed_experts(x, idx, weights, w.w1, w.w3, w.w2, limit) + _shared(w, x, limit)


def _shared(w: MoEWeights, x: torch.Tensor, limit: float) -> torch.Tensor:
    return swiglu(x, w.shared_w1, w.shared_w3, w.shared_w2, limit)


Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a tile's (x [T, D], weights [T, k], ids [T, k])


def batch_experts(
    w: MoEWeights, tiles: list[Routed], limit: float, real: int, slot_terms: bool = False
) -> list[torch.Tensor]:
    """The experts of a batched step's routed tiles (:func:`route` of each), each tile's result as
    :func:`moe` gives it. Only the first ``real`` rows of the tiles' concatenation are real; the padding rows'
    experts are not run (their result is zeros on the kernels' devices, the shared expert's elsewhere). A row's
    result depends on that row alone.

    On the kernels' devices, the routed and shared experts of every real row in a few launches, each expert's
    weights read once for all the rows that chose it (MXFP4: once for every two, decoded once for them;
    :mod:`ds4serve.kernels.expert_tiles`). Elsewhere tile by
    tile: the routed experts row by row (the grouped path's group sizes depend on every row's routing), the
    shared expert over the whole tile."""
    size = tiles[0][0].shape[0]
    if kernels.enabled(tiles[0][0]):
        from ..kernels.expert_tiles import expert_tiles

        x, weights, idx = (torch.cat(part)[:real] for part in zip(*tiles))
        experts, shared = (w.w1, w.w3, w.w2), (w.shared_w1, w.shared_w3, w.shared_w2)
        out = expert_tiles(x, idx, weights, experts, shared, limit, summed=not slot_terms)
        out = torch.cat([out, out.new_zeros(size * len(tiles) - real, *out.shape[1:])])
        return list(out.split(size))
    outs = []
    for t, (x, weights, idx) in enumerate(tiles):
        rows = min(size, real - t * size)
        parts = [
            routed_experts(x[r : r + 1], idx[r : r + 1], weights[r : r + 1], w.w1, w.w3, w.w2, limit)
            for r in range(rows)
        ]
        routed = torch.cat(parts + [x.new_zeros(size - rows, x.shape[1])])
        outs.append(routed + _shared(w, x, limit))
    return outs


def _fused_applies(x: torch.Tensor, idx: torch.Tensor) -> bool:
    """The fused decode kernels run a call of up to ``kernels.moe.MAX_PAIRS`` (token, expert) pairs: one-sequence
    decode and every verify block (the bound is that choice, not a limit of the kernels)."""
    if not kernels.enabled(x):
        return False
    from ..kernels.moe import MAX_PAIRS

    return idx.numel() <= MAX_PAIRS


def _moe_fused(
    w: MoEWeights,
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    summed: bool = True,
) -> torch.Tensor:
    """Decode path: no host synchronisation, experts read in place, the shared expert one more slot
    of the same launches when it has the routed experts' format."""
    from ..kernels import ops

    return ops.moe_decode(
        x,
        idx,
        weights,
        *_parts(w.w1),
        *_parts(w.w3),
        *_parts(w.w2),
        _block(w.w1),
        *_parts(w.shared_w1),
        *_parts(w.shared_w3),
        *_parts(w.shared_w2),
        _block(w.shared_w1),
        limit,
        summed,
    )


def _parts(w: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scale or None) of a dense, FP8 or MXFP4 weight, as the kernel op takes them."""
    return (w, None) if isinstance(w, torch.Tensor) else (w.data, w.scale)


def _block(w: Weight) -> list[int]:
    """The scale block of ``w`` as the kernel op takes it (MXFP4: one exponent per 32 inputs)."""
    return list(w.block) if isinstance(w, FP8Weight) else [1, 32]
