"""The masked softmax with a sink of block-wise chunk attention in one pass over the scores.

Between its two batched products, :func:`ds4serve.model.chunk_attention._blocks` scales the scores,
adds an fp32 ``-inf`` bias into a ``[n, block, H, K+1]`` fp32 logits tensor (rows of ``K+1``: the
sink column), writes the sinks, runs the softmax and casts the probabilities: about five passes over
the largest tensor of a prefill layer. Here one program per (query, group of heads) reads the scores
straight from the first product and writes the probabilities for the second: a first loop over key
tiles keeps the running max and sum (online softmax, so ``K`` is not bounded), a second recomputes
the logits and stores ``exp(s - max) / sum``. The mask row of a query is read once for its heads.

Rounding follows the torch code: the product ``score * scale`` is rounded to the scores' dtype (the
torch code scales in place in that dtype), then the softmax runs in fp32 with the sink ``sinks[h]``
in the max and the sum but without an output column. bf16 is rounded to nearest even on the bits,
not by a cast, so that Triton's CPU interpreter (which truncates casts to bf16) rounds as the GPU does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 4  # heads per program: they share the query's mask row
BLOCK_K = 1024  # keys per tile of the loops over a row


@triton.jit
def _logits(s_ptr, mask_row, rows, heads_in, k, K, scale, sm_k):
    """fp32 ``[BLOCK_H, BLOCK_K]`` logits of key tile ``k``: the scaled scores, ``-inf`` where not allowed."""
    keys_in = k < K
    allowed = tl.load(mask_row + k * sm_k, mask=keys_in, other=0) != 0
    x = tl.load(s_ptr + rows[:, None] + k[None, :], mask=heads_in[:, None] & keys_in[None, :], other=0.0)
    x = x.to(tl.float32) * scale
    if s_ptr.dtype.element_ty == tl.bfloat16:  # round to nearest even at bit 16 (no NaN scores)
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        x = x.to(s_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(allowed[None, :], x, float("-inf"))


@triton.jit
def _softmax_kernel(
    s_ptr,
    mask_ptr,
    sink_ptr,
    p_ptr,
    block,
    H,
    K,
    scale,
    sm_n,
    sm_b,
    sm_k,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    query = tl.program_id(0).to(tl.int64)  # i * block + r: query r of block i
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads_in = heads < H
    mask_row = mask_ptr + (query // block) * sm_n + (query % block) * sm_b
    rows = (query * H + heads) * K
    m = tl.load(sink_ptr + heads, mask=heads_in, other=0.0)
    total = tl.full([BLOCK_H], 1.0, tl.float32)  # the sink's exp(sink - m) with m = sink
    for k0 in range(0, K, BLOCK_K):
        s = _logits(s_ptr, mask_row, rows, heads_in, k0 + tl.arange(0, BLOCK_K), K, scale, sm_k)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        s = _logits(s_ptr, mask_row, rows, heads_in, k, K, scale, sm_k)
        p = tl.exp(s - m[:, None]) / total[:, None]
        tl.store(
            p_ptr + rows[:, None] + k[None, :],
            p.to(p_ptr.dtype.element_ty),
            mask=heads_in[:, None] & (k < K)[None, :],
        )


def attn_softmax(
    scores: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``softmax([round(scores * scale) masked by allowed, sinks[h]])[..., :K]`` as ``dtype``.

    ``scores [n, block, H, K]`` are the raw products (fp32, bf16 or fp16), ``allowed [n or 1, block, K]``
    bool (any strides; one row is broadcast over the blocks), ``sinks [H]``. Returns ``[n, block, H, K]``.
    """
    n, block, H, K = scores.shape
    if allowed.dim() != 3 or allowed.shape[0] not in (1, n) or tuple(allowed.shape[1:]) != (block, K):
        raise ValueError(f"mask of shape {tuple(allowed.shape)} for scores of shape {tuple(scores.shape)}")
    scores = scores.contiguous()
    probs = torch.empty(n, block, H, K, dtype=dtype, device=scores.device)
    block_h = min(BLOCK_H, triton.next_power_of_2(H))
    sm_n = 0 if allowed.shape[0] == 1 else allowed.stride(0)
    _softmax_kernel[(n * block, triton.cdiv(H, block_h))](
        scores,
        allowed,
        sinks.float().contiguous(),
        probs,
        block,
        H,
        K,
        scale,
        sm_n,
        allowed.stride(1),
        allowed.stride(2),
        BLOCK_H=block_h,
        BLOCK_K=min(BLOCK_K, triton.next_power_of_2(K)),
        num_warps=4,
    )
    return probs
