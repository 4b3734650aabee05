"""Attention of a chunk of queries over its sliding window and the compressed entries, block-wise.

A query at position ``t`` sees the window keys at ``t-W+1 .. t``, the compressed entries its mask
allows, and the per-head sink. Instead of one dense ``[S, W-1+S]`` masked matrix per head, the
queries run in blocks of ``B`` consecutive rows: a block's reachable window keys are the ``B+W-1``
consecutive rows of the window sequence (the committed ring rows in reach, then the chunk's own)
that end at its last query, and the compressed entries are appended to every block's keys, so that
each query has one softmax over window keys, entries and sink, as the dense formulation has.

With one shared K=V head the heads fold into the rows of a batched matrix product: a block is
``[B*H, d] @ [d, B+W-1+E]``, bf16 tensor-core work on the GPU. Logits, mask and softmax are those
of the dense path: scores in the activation dtype times the scale, fp32 softmax with the sink
column, probabilities cast to the keys' dtype before the product with the values.

A CSA layer's queries each see at most the indexer's ``k`` selected entries. Given as index slots
``[S, k]`` (a prefix of many entries, :func:`gathers`), each query's selected entries are gathered and
scored on their own, ``[H, d] @ [d, k]`` a query, instead of every block scoring all ``E`` entries: at a
131,072-token prefix, 512 entries a query instead of 32,768. The window's and the entries' scores share one
softmax; the two products with the values are summed in fp32 and rounded once. On the kernels' devices one
launch reads the window keys and the selected entries in place instead
(:mod:`ds4serve.kernels.sparse_attention`): no gathered copy.
"""

from __future__ import annotations

import functools

import torch

from .. import kernels

SCORES_BUDGET = 1 << 28  # fp32 logits (and gathered entries) of the blocks that run together (about 1 GiB)
# A chunk's CSA queries gather their selected entries once the prefix holds more than this many times k.
GATHER_FACTOR = 4


def gathers(n_entries: int, k: int) -> bool:
    """Whether a chunk's queries read their ``k`` selected entries of ``n_entries`` by index slots (gathered)
    rather than as a mask over all of them: the prefix alone decides, never the batch."""
    return n_entries > GATHER_FACTOR * k


# Keys per block padded (masked) to a multiple of this: with an odd count (255 window keys, +E entries)
# the batched products' leading dimensions are unaligned and cuBLAS falls back to slow sm75/sm80 kernels.
KEY_ALIGN = 32


def window_sequence(kv: torch.Tensor, ring: torch.Tensor, start: int) -> torch.Tensor:
    """The ``W-1+S`` window rows at positions ``start-W+1 ..``: ring rows in reach, then ``kv [S, d]``.

    Rows at negative positions (a chunk starting before ``W-1``) are zeros; the mask never admits them.
    """
    window = ring.shape[0]
    reach = min(start, window - 1)
    parts = [kv.new_zeros(window - 1 - reach, kv.shape[1])]
    if reach:
        parts.append(ring[torch.arange(start - reach, start, device=kv.device) % window])
    return torch.cat([*parts, kv])


def chunk_attention(
    q: torch.Tensor,
    seq: torch.Tensor,
    start: int,
    entries: torch.Tensor | None,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of ``q [S, H, d]`` at positions ``start ..`` with a per-head sink.

    ``seq`` is :func:`window_sequence` (its length fixes the window ``W``); ``entries [E, d]`` are
    the compressed keys, ``visible`` which of them each query sees: a bool mask ``[S, E]``, or int32 index
    slots ``[S, k]`` naming them (-1: unused); None: no entries. Returns ``[S, H, d]`` in the dtype of ``q``.
    """
    S, H, d = q.shape
    window = seq.shape[0] - S + 1
    block = min(S, window)
    if entries is not None and entries.shape[0] == 0:
        entries = visible = None
    if _reads_in_place(q, visible):
        from ..kernels.sparse_attention import sparse_chunk_attention

        first_key = max(0, window - 1 - start)  # the rows before it lie at negative positions
        return sparse_chunk_attention(q, seq, first_key, entries, visible, sinks, scale)
    if visible is not None and visible.dtype == torch.int32:  # scores and gathered entries of each query
        per_block = block * (H * (block + window + KEY_ALIGN + visible.shape[1]) + visible.shape[1] * d)
    else:
        per_block = block * H * (block + window + (0 if entries is None else entries.shape[0]))
    run = max(1, SCORES_BUDGET // per_block) * block
    full = S - S % block
    runs = [(first, min(run, full - first), block) for first in range(0, full, run)]
    if S % block:  # the last rows: one shorter block
        runs.append((full, S % block, S % block))
    outs = [
        _blocks(
            q[first : first + rows],
            seq,
            start,
            first,
            size,
            window,
            entries,
            None if visible is None else visible[first : first + rows],
            sinks,
            scale,
        )
        for first, rows, size in runs
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _reads_in_place(q: torch.Tensor, visible: torch.Tensor | None) -> bool:
    """Whether a chunk reads its selected entries in place (one kernel) rather than as gathered copies: index
    slots on the kernels' devices."""
    return visible is not None and visible.dtype == torch.int32 and kernels.enabled(q)


def _blocks(
    q: torch.Tensor,
    seq: torch.Tensor,
    start: int,
    first: int,
    block: int,
    window: int,
    entries: torch.Tensor | None,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Chunk rows ``first ..`` in blocks of ``block`` queries: ``q [n*block, H, d]`` → ``[n*block, H, d]``."""
    n, H, d = q.shape[0] // block, q.shape[1], q.shape[2]
    span = block + window - 1
    # block i reads seq rows first + i*block .. + span - 1 (positions start - W + 1 + first + i*block ..)
    keys = seq[first : first + (n - 1) * block + span].unfold(0, span, block).transpose(1, 2)  # [n, span, d]
    allowed = _window_mask(n, block, window, start - window + 1 + first, q.device).expand(n, -1, -1)
    key_parts, mask_parts = [keys], [allowed]
    gathered = visible is not None and visible.dtype == torch.int32
    if entries is not None and not gathered:
        key_parts.append(entries.expand(n, -1, -1))
        mask_parts.append(visible.reshape(n, block, -1))
    pad = -sum(k.shape[1] for k in key_parts) % KEY_ALIGN
    if pad:
        key_parts.append(keys.new_zeros(n, pad, d))
        mask_parts.append(allowed.new_zeros(n, block, pad))
    keys = torch.cat(key_parts, dim=1)
    allowed = torch.cat(mask_parts, dim=2)
    K = keys.shape[1]
    scores = torch.matmul(q.reshape(n, block * H, d), keys.transpose(1, 2)).view(n, block, H, K)
    if gathered:
        picked = entries[visible.clamp(min=0).long()]  # [n*block, k, d]; slot -1 reads entry 0, masked
        k = picked.shape[1]
        picked_scores = torch.matmul(q, picked.transpose(1, 2)).view(n, block, H, k)
        scores = torch.cat([scores, picked_scores], dim=-1)
        allowed = torch.cat([allowed.expand(n, -1, -1), (visible >= 0).view(n, block, k)], dim=-1)
    probs = _softmax(scores, allowed, sinks, scale, keys.dtype)
    if not gathered:
        return torch.matmul(probs.view(n, block * H, K), keys).view(n * block, H, d)
    out = torch.matmul(probs[..., :K].reshape(n, block * H, K), keys).view(n * block, H, d).float()
    out = out + torch.matmul(probs[..., K:].reshape(n * block, H, k), picked).float()
    return out.to(keys.dtype)


def _softmax(
    scores: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``softmax([scores * scale masked by allowed, sinks[h]])[..., :K]`` as ``dtype``: ``scores [n, block,
    H, K]``, ``allowed [n or 1, block, K]``."""
    if kernels.enabled(scores):
        from ..kernels.attn_softmax import attn_softmax

        return attn_softmax(scores, allowed, sinks, scale, dtype)
    n, block, H, K = scores.shape
    logits = torch.empty(n, block, H, K + 1, dtype=torch.float32, device=scores.device)
    bias = torch.where(allowed, 0.0, float("-inf")).unsqueeze(2)  # fp32 [n or 1, block, 1, K]
    logits[..., :K] = scores * scale + bias  # not add(out=): autograd (training) takes this form
    logits[..., K] = sinks.float()
    return torch.softmax(logits, dim=-1)[..., :K].to(dtype)


def _window_mask(n: int, block: int, window: int, first_key: int, device: torch.device) -> torch.Tensor:
    """``[n or 1, block, block+W-1]``: query r of block i sees key c iff ``r <= c <= r+W-1`` and the
    key's position ``first_key + i*block + c`` is not negative.

    Every layer of a chunk asks for the same mask, and later chunks for few others: the masks are kept
    (read only) by their arguments, those that matter (``n`` and ``first_key`` only while keys before
    position 0 are in reach), except while a CUDA graph is captured (the graph makes its own)."""
    key = (n, first_key) if first_key < 0 else (1, 0)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _build_window_mask(*key, block, window, device)
    return _kept_window_mask(*key, block, window, device)


@functools.lru_cache(maxsize=64)
def _kept_window_mask(n: int, first_key: int, block: int, window: int, device: torch.device) -> torch.Tensor:
    return _build_window_mask(n, first_key, block, window, device)


def _build_window_mask(n: int, first_key: int, block: int, window: int, device: torch.device) -> torch.Tensor:
    r = torch.arange(block, device=device).unsqueeze(-1)
    c = torch.arange(block + window - 1, device=device)
    band = (c >= r) & (c <= r + window - 1)
    if first_key >= 0:
        return band.unsqueeze(0)
    pos = first_key + block * torch.arange(n, device=device).unsqueeze(-1) + c  # [n, span]
    return band & (pos >= 0).unsqueeze(1)
