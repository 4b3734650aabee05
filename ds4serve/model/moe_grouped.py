"""Routed experts of a chunk as grouped matrix products, without synchronising with the host.

The (token, slot) pairs are sorted by expert so that every expert's rows are contiguous, and the
int32 cumulative row counts stay on the device. Dense bf16 experts on CUDA then run as one grouped
GEMM per projection (``torch._grouped_mm``: ``[M, K] @ [E, K, N]`` with the group ends ``offs``,
no host sync on SM90+); each expert output is weighted, put back in (token, slot) order and the
``k`` slots of a token are summed. Quantized (FP8 / MXFP4) experts on the kernels' devices
run as grouped GEMMs that read them in place (:mod:`ds4serve.kernels.grouped_experts`: gate-up with the
SwiGLU in one launch, then down), also without a host sync: always while a CUDA graph is captured, and
eagerly where the experts' groups are short enough for that to be faster. Otherwise quantized experts of
a long chunk run as ``torch._grouped_mm`` over groups of experts
dequantised together (one pass each, :mod:`ds4serve.kernels.dequant`), and the rest (and dtypes the
grouped products do not take) expert by expert; both read the group ends on the host once, and
dequantise only the experts in use.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.reference import swiglu_gate
from ..kernels.regions import region
from ..quant import FP4Weight, Weight
from .linear import dense, linear

EXPERT_GROUP_BYTES = 1 << 30  # dense bytes of the experts dequantised at once (grouped quantized path)


def sort_pairs(idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, ends)`` for expert ids ``idx [N, k]``.

    ``order [N*k]``: the flat pair indices ``token*k + slot`` sorted by expert (stable, so each
    expert's pairs stay in row-major order); ``ends [E]`` int32: expert ``e``'s sorted rows are
    ``ends[e-1] .. ends[e]``. The ids are sorted as int16 (a radix sort on the GPU makes one pass per key
    byte: 2 instead of the 8 of int64 ids, fewer launches for a host-bound chunk); the order is the same.
    """
    flat = idx.flatten()
    if n_experts <= torch.iinfo(torch.int16).max:
        flat = flat.to(torch.int16)
    order = torch.argsort(flat, stable=True)
    experts = torch.arange(n_experts, device=idx.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], experts, right=True).to(torch.int32)


def routed_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: Weight,
    w3: Weight,
    w2: Weight,
    limit: float,
) -> torch.Tensor:
    """``sum_j weights[:, j] * expert_{idx[:, j]}(x)`` for ``x [N, D]``: the routed part of the MoE."""
    k = idx.shape[1]
    order, ends = sort_pairs(idx, w1.shape[0])
    rows = x[order // k]
    if all(isinstance(w, torch.Tensor) for w in (w1, w3, w2)) and grouped_mm_applies(rows):
        h = swiglu_gate(grouped_mm(rows, w1, ends), grouped_mm(rows, w3, ends), limit)
        y = grouped_mm(h, w2, ends)
    elif quant_grouped_applies(rows, w1, w3, w2) and _in_place_pays(rows, w1):
        from ..kernels import grouped_experts

        h = grouped_experts.grouped_quant_gate_up(rows, w1, w3, ends, limit)
        y = grouped_experts.grouped_quant_mm(h, w2, ends)
    elif _expert_groups_apply(rows, w1.shape[0]):
        y = _expert_groups(rows, ends, w1, w3, w2, limit)
    else:
        y = _expert_by_expert(rows, ends.tolist(), w1, w3, w2, limit)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return slot_sum(y, inverse, weights, x.dtype)


@region(chunks=True)
def slot_sum(
    y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``[N, D]``: each (token, slot) pair's expert output, read from the expert-ordered rows ``y [N*k, D]`` at
    ``inverse [N*k]``, times its weight (``weights [N, k]``) and cast to ``dtype``, then the ``k`` slots of a
    token summed in fp32, in slot order, and cast once (as ``sum`` over the slots does). The slots are added
    one by one rather than reduced, so that compiled for chunks the gather, products and sum are one
    elementwise pass over ``y``, coalesced along ``D`` (an Inductor reduction over the ``k`` gathered rows ran
    at a third of the copy rate; putting the rows back in token order first took three passes)."""
    N, k = weights.shape
    terms = (y[inverse] * weights.reshape(N * k, 1)).to(dtype).view(N, k, -1)
    acc = terms[:, 0].float()
    for j in range(1, k):
        acc = acc + terms[:, j].float()
    return acc.to(dtype)


def grouped_mm_applies(a: torch.Tensor) -> bool:
    """True where ``torch._grouped_mm`` takes activations like ``a``: bf16 on CUDA (the no-sync
    grouped kernel), bf16 / fp32 on the CPU (torch's per-group reference)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return a.dtype == torch.bfloat16 if a.is_cuda else a.dtype in (torch.bfloat16, torch.float32)


def grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``ends[e-1] .. ends[e]`` of ``a [M, K]`` times ``w[e].T`` for ``w [E, N, K]``: ``[M, N]``.

    The transposed weight view is column-major, the layout the grouped kernel reads in place.
    """
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=ends)


def quant_grouped_applies(like: torch.Tensor, w1: Weight, w3: Weight, w2: Weight) -> bool:
    """Whether quantized experts run through :mod:`ds4serve.kernels.grouped_experts` for activations like
    ``like`` (dtype and device): on the kernels' devices, outside
    compiled regions (the kernels are not custom ops that Dynamo could trace), and for experts the kernels
    take (FP8 / MXFP4 with scale blocks they handle)."""
    if not (kernels.enabled(like) and not torch.compiler.is_compiling()):
        return False
    from ..kernels import grouped_experts

    return grouped_experts.supports(like.dtype, w1, w3) and grouped_experts.supports(like.dtype, w2)


def _in_place_pays(rows: torch.Tensor, w1: Weight) -> bool:
    """Whether the quantized experts of a chunk of ``rows`` run in place: while a CUDA graph is captured (the
    other paths read the group ends on the host), or where the groups are short enough to be faster so."""
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    from ..kernels.grouped_experts import IN_PLACE_MAX_ROWS_PER_EXPERT

    fmt = "fp4" if isinstance(w1, FP4Weight) else "fp8"
    return rows.shape[0] <= IN_PLACE_MAX_ROWS_PER_EXPERT[fmt] * w1.shape[0]


def _expert_groups_apply(rows: torch.Tensor, n_experts: int) -> bool:
    """Quantized experts as grouped GEMMs over dequantised groups: on the kernels' devices, where the grouped product takes the rows, and for chunks with at least as many
    (token, slot) pairs as experts (most experts in use, so dequantising whole groups wastes little)."""
    return kernels.enabled(rows) and grouped_mm_applies(rows) and rows.shape[0] >= n_experts


def _expert_groups(
    rows: torch.Tensor, ends: torch.Tensor, w1: Weight, w3: Weight, w2: Weight, limit: float
) -> torch.Tensor:
    """:func:`routed_experts`' products for quantized experts: consecutive experts, up to
    ``EXPERT_GROUP_BYTES`` of them dense, dequantised together and run as one grouped GEMM per
    projection over their rows (one host read of the group ends, as expert by expert)."""
    E = w1.shape[0]
    per_expert = rows.element_size() * sum(w.shape[-2] * w.shape[-1] for w in (w1, w3, w2))
    step = max(1, EXPERT_GROUP_BYTES // per_expert)
    bounds = [0, *ends.tolist()]
    out = rows.new_empty(rows.shape[0], w2.shape[-2])
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        begin, end = bounds[e0], bounds[e1]
        if end == begin:
            continue
        part, offs = rows[begin:end], ends[e0:e1] - begin
        gate, up, down = (dense(w[e0:e1], rows.dtype) for w in (w1, w3, w2))
        h = swiglu_gate(grouped_mm(part, gate, offs), grouped_mm(part, up, offs), limit)
        out[begin:end] = grouped_mm(h, down, offs)
    return out


def _expert_by_expert(
    rows: torch.Tensor, ends: list[int], w1: Weight, w3: Weight, w2: Weight, limit: float
) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], w2.shape[-2])
    begin = 0
    for e, end in enumerate(ends):
        if end > begin:
            part = rows[begin:end]
            out[begin:end] = linear(swiglu_gate(linear(part, w1[e]), linear(part, w3[e]), limit), w2[e])
        begin = end
    return out
