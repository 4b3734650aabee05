"""A prefill chunk's CSA attention over its sliding window and its selected entries, read in place.

The torch path (:func:`ds4serve.model.chunk_attention.chunk_attention` with index slots) gathers each
query's ``k`` selected entries into a dense ``[S, k, d]`` copy (2 GB for a 4096-token chunk with ``k`` = 512
and ``d`` = 512), multiplies the queries with it twice and adds the window's and the entries' products in
fp32. Here one launch: a program per (query row, block of ``BLOCK_H`` heads) keeps an online softmax in
fp32 over the row's window keys (the ``W`` rows of the window sequence ending at its own, a contiguous
range) and then its selected entries (tiles of the index slots, -1 unused), each key tile read once for
both products on the tensor cores (:func:`ds4serve.kernels.decode_attention.online_update`), and writes
the row's output with the sink in the denominator. Nothing of size ``k * d`` per query reaches memory.

The scores stay in fp32 (the torch path rounds them to the keys' dtype) and the unnormalised
probabilities are rounded to the keys' dtype for the second product, as in the decode attention kernel:
the results agree with the torch path within the activations' rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .decode_attention import head_block, keys_tile, online_update


@dataclass(frozen=True)
class SparseAttentionConfig:
    block_h: int  # heads per program (tl.dot needs at least 16 rows)
    block_n: int  # keys per tile (a power of two, >= 16)
    warps: int


# all 64 heads a program, 32-key tiles, 8 warps: the fastest of bench/sweep_sparse_attention.py on the H200 (a
# 4096-token chunk over 32,768 entries: 2.51 ms; 16 heads 3.80, 32 heads 2.67; the gathered copies 5.31)
DEFAULT_CONFIG = SparseAttentionConfig(64, 32, 8)


@triton.jit
def _sparse_kernel(
    q_ptr,
    seq_ptr,
    entries_ptr,
    slots_ptr,
    sink_ptr,
    out_ptr,
    H,
    window,
    first_key,
    k,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    s, heads, d, q = head_block(q_ptr, H, BLOCK_H, D, D_P, WIDEN)
    heads_in = heads < H
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_P], tl.float32)
    # the window: sequence rows s .. s + window - 1 (the last is the query's own), none before first_key;
    # every tile holds at least one of them
    hi = s + window
    for k0 in range(tl.maximum(s, first_key), hi, BLOCK_N):
        rows = k0 + tl.arange(0, BLOCK_N)
        ok = rows < hi
        kt = keys_tile(seq_ptr, rows, ok, seq_ptr, -1, D, D_P, False)
        m, total, acc = online_update(q, kt, ok, m, total, acc, scale, WIDEN)
    for j0 in range(0, k, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        rows = tl.load(slots_ptr + s.to(tl.int64) * k + j, mask=j < k, other=-1)
        ok = rows >= 0
        if tl.max(ok.to(tl.int32), axis=0) > 0:
            kt = keys_tile(entries_ptr, rows, ok, entries_ptr, -1, D, D_P, False)
            m, total, acc = online_update(q, kt, ok, m, total, acc, scale, WIDEN)
    sink = tl.load(sink_ptr + heads, mask=heads_in, other=0.0).to(tl.float32)
    top = tl.maximum(m, sink)
    w = tl.exp(m - top)
    out = acc * w[:, None] / (total * w + tl.exp(sink - top))[:, None]
    at = (s * H + heads[:, None]) * D + d[None, :]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=heads_in[:, None] & (d < D)[None, :])


def sparse_chunk_attention(
    q: torch.Tensor,
    seq: torch.Tensor,
    first_key: int,
    entries: torch.Tensor,
    slots: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    config: SparseAttentionConfig | None = None,
) -> torch.Tensor:
    """``[S, H, d]`` in ``q``'s dtype: per query row ``s`` of ``q [S, H, d]``, the softmax attention with the
    sink ``sinks [H]`` over the window keys ``seq[max(s, first_key) : s + W]`` (``seq [W-1+S, d]``, K = V, the
    window sequence whose rows before ``first_key`` lie at negative positions) and the entries ``entries
    [E, d]`` named by ``slots [S, k]`` (int32, -1 unused)."""
    S, H, D = q.shape
    window = seq.shape[0] - S + 1
    if seq.dim() != 2 or seq.shape[1] != D or entries.dim() != 2 or entries.shape[1] != D or window < 1:
        raise ValueError(
            f"sparse_chunk_attention: window sequence {tuple(seq.shape)} and entries {tuple(entries.shape)} "
            f"for queries {tuple(q.shape)}"
        )
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[0] != S:
        raise ValueError(f"sparse_chunk_attention: int32 slots [{S}, k] expected, got {tuple(slots.shape)}")
    if not 0 <= first_key < window or seq.dtype != q.dtype or entries.dtype != q.dtype:
        raise ValueError(
            f"sparse_chunk_attention: first_key {first_key} for a window of {window}, keys {seq.dtype} and "
            f"{entries.dtype} for {q.dtype} queries"
        )
    cfg = config or DEFAULT_CONFIG
    out = torch.empty_like(q)
    _sparse_kernel[(S * triton.cdiv(H, cfg.block_h),)](
        q.contiguous(),
        seq.contiguous(),
        entries.contiguous(),
        slots.contiguous(),
        sinks,
        out,
        H,
        window,
        first_key,
        slots.shape[1],
        scale,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        D=D,
        D_P=max(16, triton.next_power_of_2(D)),
        WIDEN=not q.is_cuda,
        num_warps=cfg.warps,
        **pdl.launch(q),
    )
    return out
