"""Attention of the static decode step (one or a few query rows) in two launches.

The torch reference (:func:`ds4serve.model.attention._core`, after the ``torch.cat`` of the key
parts in ``_attend``) becomes about six kernels per layer under Inductor: the cat, two cuBLAS
products and the softmax with the sink between them. Here, flash-decoding over the key parts in
place (the window ring, then the compressed entries when the layer has them; K = V):

* :func:`_partial_kernel`: one program per (query row, block of ``BLOCK_H`` heads) and chunk of
  keys. A chunk lies inside one part, so no key tile straddles two tensors. Per tile of
  ``BLOCK_N`` keys the program reads the tile once for both products on the tensor cores
  (``q k^T``, then ``p k``) and keeps an online softmax in fp32: its running max, sum and
  unnormalised ``[BLOCK_H, d]`` output. A tile whose keys are all masked is skipped (the static
  entry buffer is sized for the longest context), and masked key rows are not read.
* :func:`_combine_kernel`: one program per (query row, head) and slice of the head dim merges
  the chunks' partials with the sink logit in the denominator, in a fixed order (deterministic).
  It runs without FP contraction (``hc_streams.EXACT_ROUNDING``: each product rounded, none folded
  into a multiply-add).

A query row that sees no key gets only the sink's weight: its output is 0, as in the reference.
The scores stay in fp32 (the reference rounds them to the keys' dtype) and, with bf16 keys, the
unnormalised probabilities are rounded to bf16 for the second product, as in flash attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .hc_streams import EXACT_ROUNDING

BLOCK_H = 16  # heads per program: tl.dot needs at least 16 rows


@dataclass(frozen=True)
class DecodeAttentionConfig:
    block_n: int = 32  # keys per tile (a power of two, >= 16)
    # target programs of the first launch: it sets the keys per chunk. 256: a one-token step at a million tokens
    # (8,192 HCA entries a layer) 8.07 -> 7.90 ms a replay against 128; a short context's step is the same
    # (its key parts are fewer tiles than either target: one tile a chunk)
    programs: int = 256
    warps: int = 4
    combine_tile: int = 4096  # fp32 partial elements ([chunks, head-dim slice]) per combine program


@triton.jit
def online_update(q, kt, ok, m, total, acc, scale, WIDEN: tl.constexpr):
    """The online softmax state after a tile of keys ``kt [BLOCK_N, D_P]`` with at least one ``ok`` row."""
    if WIDEN:  # Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; fp32 is exact
        kt = kt.to(tl.float32)
    s = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N] fp32
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: the tile has an allowed key
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(kt.dtype), kt, acc * alpha[:, None], input_precision="ieee")
    return m_new, total, acc


@triton.jit
def head_block(q_ptr, H, BLOCK_H: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, WIDEN: tl.constexpr):
    """This program's query row ``s`` and block of ``BLOCK_H`` heads (program axis 0 runs over rows x head
    blocks of ``q [S, H, D]``): ``(s, heads, d, q)``, ``q`` the ``[BLOCK_H, D_P]`` queries (0 past ``H`` heads
    and ``D`` dims; fp32 with ``WIDEN``)."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    s = tl.program_id(0) // head_blocks
    heads = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_P)
    q = tl.load(
        q_ptr + (s * H + heads[:, None]) * D + d[None, :],
        mask=(heads < H)[:, None] & (d < D)[None, :],
        other=0.0,
    )
    if WIDEN:  # Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; fp32 is exact
        q = q.to(tl.float32)
    return s, heads, d, q


@triton.jit
def keys_tile(keys, rows, ok, open_row, open_at, D: tl.constexpr, D_P: tl.constexpr, OPEN: tl.constexpr):
    """The key rows ``rows`` where ``ok`` (0 elsewhere); with ``OPEN``, the row at slot ``open_at`` is
    ``open_row``'s (the entry the step holds apart from the buffer)."""
    d = tl.arange(0, D_P)
    kt = tl.load(
        keys + rows[:, None].to(tl.int64) * D + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0
    )
    if OPEN:
        is_open = ok & (rows == open_at)
        if tl.max(is_open.to(tl.int32), axis=0) > 0:
            kt = tl.where(is_open[:, None], tl.load(open_row + d, mask=d < D, other=0.0)[None, :], kt)
    return kt


@triton.jit
def _tile(
    q,
    keys,
    allowed,
    k,
    hi,
    m,
    total,
    acc,
    scale,
    open_row,
    open_at,
    D: tl.constexpr,
    D_P: tl.constexpr,
    GATHER: tl.constexpr,
    OPEN: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """The online softmax state after tile ``k`` of a key part, unchanged when none of its keys is allowed:
    ``allowed`` is the part's bool mask, or (``GATHER``) int32 index slots naming its rows (-1: unused)."""
    if GATHER:
        rows = tl.load(allowed + k, mask=k < hi, other=-1)
        ok = rows >= 0
    else:
        rows = k
        ok = tl.load(allowed + k, mask=k < hi, other=0) != 0
    if tl.max(ok.to(tl.int32), axis=0) > 0:
        kt = keys_tile(keys, rows, ok, open_row, open_at, D, D_P, OPEN)
        m, total, acc = online_update(q, kt, ok, m, total, acc, scale, WIDEN)
    return m, total, acc


@triton.jit(do_not_specialize=["n0", "n1", "chunks0", "chunk", "sa0", "sa1"])
def _partial_kernel(
    q_ptr,
    k0_ptr,
    a0_ptr,
    k1_ptr,
    a1_ptr,
    open_ptr,
    open_at_ptr,
    m_ptr,
    sum_ptr,
    acc_ptr,
    H,
    n0,
    n1,
    chunks0,
    chunk,
    scale,
    sa0,
    sa1,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    GATHER1: tl.constexpr,
    OPEN1: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    # GATHER1: the second part's "mask" is int32 index slots [S, n1] naming its rows (-1: unused)
    # OPEN1: the second part's row at slot open_at_ptr[0] is read from open_ptr
    pdl.start(PDL)
    s, heads, d, q = head_block(q_ptr, H, BLOCK_H, D, D_P, WIDEN)
    heads_in = heads < H
    c = tl.program_id(1)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_P], tl.float32)
    if c < chunks0:
        lo = c * chunk
        hi = tl.minimum(lo + chunk, n0)
        for k0 in range(lo, hi, BLOCK_N):
            m, total, acc = _tile(
                q,
                k0_ptr,
                a0_ptr + s * sa0,
                k0 + tl.arange(0, BLOCK_N),
                hi,
                m,
                total,
                acc,
                scale,
                open_ptr,
                0,
                D,
                D_P,
                False,
                False,
                WIDEN,
            )
    else:
        lo = (c - chunks0) * chunk
        hi = tl.minimum(lo + chunk, n1)
        open_at = -1
        if OPEN1:
            open_at = tl.load(open_at_ptr)
        for k0 in range(lo, hi, BLOCK_N):
            m, total, acc = _tile(
                q,
                k1_ptr,
                a1_ptr + s * sa1,
                k0 + tl.arange(0, BLOCK_N),
                hi,
                m,
                total,
                acc,
                scale,
                open_ptr,
                open_at,
                D,
                D_P,
                GATHER1,
                OPEN1,
                WIDEN,
            )
    row = (s * H + heads) * tl.num_programs(1) + c  # partials [S, H, chunks(, D)]
    tl.store(m_ptr + row, m, mask=heads_in)
    tl.store(sum_ptr + row, total, mask=heads_in)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=heads_in[:, None] & (d < D)[None, :])


@triton.jit
def _combine_kernel(
    m_ptr,
    sum_ptr,
    acc_ptr,
    sink_ptr,
    out_ptr,
    H,
    chunks,
    D: tl.constexpr,
    C_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    row = tl.program_id(0)  # s * H + h
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c = tl.arange(0, C_P)
    c_in = c < chunks
    m = tl.load(m_ptr + row * chunks + c, mask=c_in, other=float("-inf"))
    total = tl.load(sum_ptr + row * chunks + c, mask=c_in, other=0.0)
    sink = tl.load(sink_ptr + row % H).to(tl.float32)
    top = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - top)  # 0 for a chunk without an allowed key (m = -inf)
    denom = tl.sum(total * w, axis=0) + tl.exp(sink - top)
    part = tl.load(
        acc_ptr + (row * chunks + c)[:, None] * D + dd[None, :],
        mask=c_in[:, None] & (dd < D)[None, :],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], axis=0) / denom
    tl.store(out_ptr + row * D + dd, out.to(out_ptr.dtype.element_ty), mask=dd < D)


def decode_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    allowed: list[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    config: DecodeAttentionConfig | None = None,
    open_entry: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``softmax([scale q.k where allowed, sinks[h]])[:K] @ keys`` as ``[S, H, d]`` in ``q``'s dtype.

    ``q [S, H, d]``; ``keys``: one or two parts ``[K_i, d]`` (shared K = V, ``q``'s dtype) taken as
    one concatenated key sequence; ``allowed``: their bool masks ``[S or 1, K_i]``, or for the second
    part int32 index slots ``[S or 1, k]``: the rows it admits, -1 for an unused slot (the indexer's
    selection: only those rows are read, where a mask would visit every tile holding one); ``sinks [H]``.
    ``open_entry``: the second part's row at its slot is read from its row instead (a one-token step's
    entry of the window it is in, which the step does not write into the buffer).
    """
    S, H, D = q.shape
    cfg = config or DecodeAttentionConfig()
    parts = _parts(keys, allowed, S, D, q.dtype)
    gather = len(parts) > 1 and parts[1][1].dtype == torch.int32
    sizes = [k.shape[0] for k, _ in parts[:1]] + [a.shape[1] if gather else k.shape[0] for k, a in parts[1:]]
    head_programs = S * triton.cdiv(H, BLOCK_H)
    chunk = _chunk(sizes, head_programs, cfg)
    n0, n1 = sizes[0], sizes[1] if len(parts) > 1 else 0
    chunks0 = triton.cdiv(n0, chunk)
    chunks = chunks0 + triton.cdiv(n1, chunk)
    (k0, a0), (k1, a1) = parts[0], parts[-1]  # a window-only layer passes the window twice, with no entries
    if open_entry is not None and len(parts) < 2:
        raise ValueError("decode_attention: an open entry needs a second key part")
    open_row, open_at = open_entry if open_entry is not None else (k1, a1)
    stats = torch.empty(2, S, H, chunks, device=q.device, dtype=torch.float32)
    partial = torch.empty(S, H, chunks, D, device=q.device, dtype=torch.float32)
    D_P = max(16, triton.next_power_of_2(D))
    _partial_kernel[(head_programs, chunks)](
        q.contiguous(),
        k0,
        a0,
        k1,
        a1,
        open_row,
        open_at,
        stats[0],
        stats[1],
        partial,
        H,
        n0,
        n1,
        chunks0,
        chunk,
        scale,
        _row_stride(a0),
        _row_stride(a1),
        BLOCK_H=BLOCK_H,
        BLOCK_N=cfg.block_n,
        D=D,
        D_P=D_P,
        GATHER1=gather,
        OPEN1=open_entry is not None,
        WIDEN=not q.is_cuda,
        num_warps=cfg.warps,
        **pdl.launch(q),
    )
    out = torch.empty(S, H, D, device=q.device, dtype=q.dtype)
    C_P = triton.next_power_of_2(chunks)
    block_d = max(1, min(D_P, cfg.combine_tile // C_P))
    _combine_kernel[(S * H, triton.cdiv(D, block_d))](
        stats[0],
        stats[1],
        partial,
        sinks,
        out,
        H,
        chunks,
        D=D,
        C_P=C_P,
        BLOCK_D=block_d,
        num_warps=4,
        **EXACT_ROUNDING,
        **pdl.launch(q),
    )
    return out


def _parts(
    keys: list[torch.Tensor], allowed: list[torch.Tensor], S: int, D: int, q_dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The key parts with their masks, checked and made contiguous (no copy in the model)."""
    if not 1 <= len(keys) <= 2 or len(allowed) != len(keys):
        raise ValueError(
            f"decode_attention: one or two key parts with one mask each, got {len(keys)} and {len(allowed)}"
        )
    parts = []
    for i, (k, a) in enumerate(zip(keys, allowed)):
        indexed = a.dtype == torch.int32
        if indexed and i == 0:
            raise ValueError("decode_attention: index slots are for the second key part only")
        if (
            k.dim() != 2
            or k.shape[1] != D
            or a.dim() != 2
            or a.shape[0] not in (1, S)
            or (a.shape[1] != k.shape[0] and not indexed)
        ):
            raise ValueError(
                f"decode_attention: keys {tuple(k.shape)} with mask {tuple(a.shape)} for {S} rows of "
                f"head dim {D}"
            )
        if k.dtype != q_dtype:
            raise ValueError(f"decode_attention: {k.dtype} keys for {q_dtype} queries")
        parts.append((k.contiguous(), a.contiguous()))
    if parts[0][0].shape[0] == 0:
        raise ValueError("decode_attention: the first key part is empty")
    return parts


def _row_stride(allowed: torch.Tensor) -> int:
    """0 broadcasts a one-row mask over the query rows."""
    return allowed.stride(0) if allowed.shape[0] > 1 else 0


def _chunk(sizes: list[int], head_programs: int, cfg: DecodeAttentionConfig) -> int:
    """Keys per program of the first launch: whole tiles, so that it has about ``cfg.programs`` programs."""
    tiles = sum(triton.cdiv(n, cfg.block_n) for n in sizes)
    return max(1, triton.cdiv(tiles * head_programs, cfg.programs)) * cfg.block_n
