"""The MoE router of a decode step in one launch: gate product, sqrt-softplus, top-k and weights.

:func:`route_decode` equals :func:`route_ref` (:func:`ds4serve.model.moe.route`'s code) for up to
:data:`MAX_ROWS` tokens. Grid ``(ceil(E / block_e), split)``: program ``(b, s)`` multiplies gate rows ``[b block_e, (b+1) block_e)`` by
input slice ``s`` of every token (fp32 accumulation, so the 2 MB gate of the real model streams through ~256
programs; the first step of its gate rows is read before the PDL wait, as no kernel writes the gate) and stores the fp32 partial to a scratch ``[split, N, E]``. Then it counts itself
in on an arrival counter (:mod:`ds4serve.kernels.arrival`); the last program sums the partials in split order
(deterministic, whichever program came last) and finishes every row: the scores, the selection (``k`` rounds of
an argmax whose key packs the value with the expert index, so that a tie goes to the lower index as in
:func:`ds4serve.kernels.reference.top_k_indices`) or, for a hash layer, the experts of ``tid2eid[token]``, then the
gathered scores normalised and scaled.

Rounding follows the torch code (:func:`route_ref`): the logits are rounded to x's dtype, as
``F.linear`` returns them; softplus, sqrt, the sum, the ``+ 1e-20``, the division and the scaling each
compute in fp32 and round to x's dtype, as torch's bf16 ops do; the selection compares the rounded
scores plus the fp32 bias in fp32. The rounding to bf16 is done on the fp32 bits (to nearest even), so
that Triton's CPU interpreter, whose casts truncate, rounds as the GPU and torch do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .arrival import counters, last_to_arrive
from .gemv import SMS
from .reference import top_k_indices
from .tl_common import round_bf16

MAX_ROWS = 16  # tokens a call (decode, short verify blocks)
MAX_EXPERTS = 512  # the last program holds every row's [N, E] scores in registers
MIN_SLICE = 256  # inputs per program at least, when splitting the input
_INDEX_SPAN = tl.constexpr(1024)  # above every expert index: the selection key is 1024 order - index
_TAKEN = tl.constexpr(-(2**62))  # below every packed key: an expert already selected, or padding


@dataclass(frozen=True)
class RouterConfig:
    block_e: int  # gate rows (experts) per program, a power of two
    block_k: int  # inputs per loop step, a power of two
    split: int = 1  # slices of the input, one program each per block of experts
    warps: int = 4
    stages: int = 2  # loop steps in flight when a slice takes several


@functools.cache
def default_config(n_experts: int, dim: int, n_rows: int) -> RouterConfig:
    """Eight gate rows per program, the input halved until there are as many programs as SMs or a slice
    would fall below :data:`MIN_SLICE` inputs: E=256, D=4096 gives 32 x 8 = 256 programs of 8 KB each, E=32
    4 x 16 = 64 of 4 KB. ``block_k`` keeps the accumulator ``[N, block_e, block_k]`` at 32 values a thread
    (4 warps); 8 warps when the last program's ``[N, E]`` tiles are large."""
    rows = triton.next_power_of_2(n_rows)
    block_e = 8
    split = 1
    while triton.cdiv(n_experts, block_e) * split < SMS and dim // (2 * split) >= MIN_SLICE:
        split *= 2
    warps = 4 if rows * triton.next_power_of_2(n_experts) <= 4096 else 8
    return RouterConfig(block_e=block_e, block_k=512 // rows, split=split, warps=warps)


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20); log1p(u) as ``log(1 + u) * u / ((1 + u) - 1)``, exact to a
    few ulps where ``1 + u`` rounds. The exponent is taken of 0 above the threshold (no overflow)."""
    above = x > 20.0
    u = tl.exp(tl.where(above, 0.0, x))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, w - 1.0))
    return tl.where(above, x, log1p)


@triton.jit
def _top_k(v, valid, N_PAD: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr):
    """int32 ``[N_PAD, K_PAD]``: per row, the indices of the ``K`` largest of ``v [N_PAD, E_PAD]`` among the
    ``valid`` columns, best first, ties to the lower index. Each round is one max over the int64 keys
    ``1024 order - index``, ``order`` the value's order-preserving int32 image (-0.0 as +0.0)."""
    e = tl.arange(0, E_PAD)
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    order = b ^ ((b >> 31) & 0x7FFFFFFF)
    packed = tl.where(valid[None, :], order.to(tl.int64) * _INDEX_SPAN - e[None, :], _TAKEN)
    slots = tl.arange(0, K_PAD)
    idx = tl.zeros([N_PAD, K_PAD], tl.int32)
    for j in tl.static_range(K):
        best = tl.max(packed, axis=1)
        idx = tl.where(slots[None, :] == j, ((-best) & (_INDEX_SPAN - 1)).to(tl.int32)[:, None], idx)
        packed = tl.where(packed == best[:, None], _TAKEN, packed)
    return idx


@triton.jit
def _finish(
    part_ptr,
    bias_ptr,
    tid2eid_ptr,
    ids_ptr,
    w_out_ptr,
    idx_out_ptr,
    n_tokens,
    n_experts,
    tid2eid_stride,
    scaling,
    K: tl.constexpr,
    N_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    HASH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16: tl.constexpr,
):
    """The last program: every row's logits from the partials, the scores, the experts and their weights."""
    tokens = tl.arange(0, N_PAD)
    e = tl.arange(0, E_PAD)
    slots = tl.arange(0, K_PAD)
    tmask = tokens < n_tokens
    emask = e < n_experts
    out_mask = tmask[:, None] & (slots < K)[None, :]
    rows = part_ptr + tokens[:, None] * n_experts + e[None, :]
    logits = tl.zeros([N_PAD, E_PAD], tl.float32)
    for s in tl.static_range(SPLIT):
        logits += tl.load(
            rows + s * n_tokens * n_experts,
            mask=tmask[:, None] & emask[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
    scores = round_bf16(tl.sqrt_rn(round_bf16(_softplus(round_bf16(logits, BF16)), BF16)), BF16)
    if HASH:
        ids = tl.load(ids_ptr + tokens, mask=tmask, other=0)
        idx = tl.load(tid2eid_ptr + ids[:, None] * tid2eid_stride + slots[None, :], mask=out_mask, other=0)
        idx = idx.to(tl.int32)
    else:
        v = scores
        if HAS_BIAS:
            v += tl.load(bias_ptr + e, mask=emask, other=0.0)[None, :]
        idx = _top_k(v, emask, N_PAD, E_PAD, K, K_PAD)
    w = tl.where(out_mask, tl.gather(scores, idx, axis=1), 0.0)
    total = round_bf16(tl.sum(w, axis=1), BF16)
    w = round_bf16(tl.math.div_rn(w, round_bf16(total + 1e-20, BF16)[:, None]), BF16)
    w = round_bf16(w * scaling, BF16)
    out = tokens[:, None] * K + slots[None, :]
    tl.store(w_out_ptr + out, w.to(w_out_ptr.dtype.element_ty), mask=out_mask)
    tl.store(idx_out_ptr + out, idx.to(tl.int64), mask=out_mask)


@triton.jit
def _gate_tile(w_rows, k0, k_hi, emask, BLOCK_K: tl.constexpr):
    """``[1, BLOCK_E, BLOCK_K]`` fp32: the program's gate rows at inputs ``[k0, k0 + BLOCK_K)`` (0 past ``k_hi``)."""
    cols = k0 + tl.arange(0, BLOCK_K)[None, None, :]
    return tl.load(w_rows + cols, mask=emask[None, :, None] & (cols < k_hi), other=0.0).to(tl.float32)


@triton.jit
def _x_tile(x_rows, k0, k_hi, tmask, BLOCK_K: tl.constexpr):
    """``[N_PAD, 1, BLOCK_K]`` fp32: the tokens' inputs ``[k0, k0 + BLOCK_K)`` (0 past ``k_hi``)."""
    cols = k0 + tl.arange(0, BLOCK_K)[None, None, :]
    return tl.load(x_rows + cols, mask=tmask[:, None, None] & (cols < k_hi), other=0.0).to(tl.float32)


@triton.jit
def _router_kernel(
    x_ptr,
    gate_ptr,
    bias_ptr,
    tid2eid_ptr,
    ids_ptr,
    part_ptr,
    count_ptr,
    w_out_ptr,
    idx_out_ptr,
    n_tokens,
    n_experts,
    dim,
    x_stride,
    k_per_split,
    tid2eid_stride,
    scaling,
    K: tl.constexpr,
    N_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
    HASH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    split = tl.program_id(1)
    tokens = tl.arange(0, N_PAD)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    tmask = tokens < n_tokens
    emask = e < n_experts
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, dim)
    w_rows = gate_ptr + e[None, :, None].to(tl.int64) * dim
    # the gate is a weight, which no kernel before writes: the first step's tile (often the program's whole
    # slice) is read before the PDL wait, its latency overlapping the kernel before instead of following it
    w = _gate_tile(w_rows, k_lo, k_hi, emask, BLOCK_K)
    pdl.start(PDL)
    x_rows = x_ptr + tokens[:, None, None] * x_stride
    acc = tl.zeros([N_PAD, BLOCK_E, BLOCK_K], tl.float32)
    acc += w * _x_tile(x_rows, k_lo, k_hi, tmask, BLOCK_K)
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        acc += _gate_tile(w_rows, k0, k_hi, emask, BLOCK_K) * _x_tile(x_rows, k0, k_hi, tmask, BLOCK_K)
    part = part_ptr + (split * n_tokens + tokens[:, None]) * n_experts + e[None, :]
    tl.store(part, tl.sum(acc, axis=2), mask=tmask[:, None] & emask[None, :])
    if last_to_arrive(count_ptr, tl.num_programs(0) * tl.num_programs(1)):
        _finish(
            part_ptr,
            bias_ptr,
            tid2eid_ptr,
            ids_ptr,
            w_out_ptr,
            idx_out_ptr,
            n_tokens,
            n_experts,
            tid2eid_stride,
            scaling,
            K,
            N_PAD,
            E_PAD,
            K_PAD,
            SPLIT,
            HASH,
            HAS_BIAS,
            BF16,
        )


def route_decode(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    token_ids: torch.Tensor,
    k: int,
    scaling: float,
    config: RouterConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] in x's dtype, expert ids [N, k] int64)`` of :func:`route_ref`, in one launch.

    ``x [N, D]`` (bf16 or fp32, N <= :data:`MAX_ROWS`), ``gate [E, D]`` dense and contiguous, ``bias [E]``
    fp32 or None; ``tid2eid [V, k]`` (a hash layer: the experts of ``token_ids [N]``) or None. ``gate`` is a
    weight: it is read before the launch's PDL wait, so the kernel just before must not write it. Two launches
    must not run concurrently on one device (they share the arrival counters).
    """
    n_tokens, dim = x.shape
    n_experts = gate.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"route_decode: x must be bf16 or fp32, not {x.dtype}")
    if gate.shape != (n_experts, dim) or not gate.is_contiguous():
        raise ValueError(
            f"route_decode: the gate must be a contiguous [E, {dim}] tensor, not {tuple(gate.shape)}"
        )
    if not (0 < n_tokens <= MAX_ROWS and 0 < k <= n_experts <= MAX_EXPERTS):
        raise ValueError(
            f"route_decode: {n_tokens} rows (at most {MAX_ROWS}), top-{k} of {n_experts} experts "
            f"(at most {MAX_EXPERTS})"
        )
    if tid2eid is not None and (tid2eid.dim() != 2 or tid2eid.shape[1] != k or tid2eid.stride(1) != 1):
        raise ValueError(
            f"route_decode: tid2eid must be [V, {k}] with contiguous rows, not {tuple(tid2eid.shape)}"
        )
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or default_config(n_experts, dim, n_tokens)
    k_per_split = triton.cdiv(triton.cdiv(dim, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(dim, k_per_split)
    part = torch.empty(split, n_tokens, n_experts, device=x.device, dtype=torch.float32)
    weights = torch.empty(n_tokens, k, device=x.device, dtype=x.dtype)
    idx = torch.empty(n_tokens, k, device=x.device, dtype=torch.int64)
    grid = (triton.cdiv(n_experts, cfg.block_e), split)
    _router_kernel[grid](
        x,
        gate,
        bias,
        tid2eid,
        token_ids.reshape(-1),
        part,
        counters(x.device, 1),
        weights,
        idx,
        n_tokens,
        n_experts,
        dim,
        x.stride(0),
        k_per_split,
        tid2eid.stride(0) if tid2eid is not None else 0,
        scaling,
        K=k,
        N_PAD=triton.next_power_of_2(n_tokens),
        E_PAD=triton.next_power_of_2(n_experts),
        K_PAD=triton.next_power_of_2(k),
        BLOCK_E=cfg.block_e,
        BLOCK_K=cfg.block_k,
        SPLIT=split,
        STAGES=cfg.stages,
        HASH=tid2eid is not None,
        HAS_BIAS=bias is not None,
        BF16=x.dtype == torch.bfloat16,
        num_warps=cfg.warps,
        **pdl.launch(x),
    )
    return weights, idx


def route_ref(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    token_ids: torch.Tensor,
    k: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: :func:`ds4serve.model.moe.route`'s code with ``F.linear`` for the gate product."""
    scores = torch.nn.functional.softplus(torch.nn.functional.linear(x, gate)).sqrt()
    if tid2eid is not None:
        idx = tid2eid[token_ids]
    else:
        idx = top_k_indices(scores if bias is None else scores + bias, k)
    weights = scores.gather(1, idx)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, idx
