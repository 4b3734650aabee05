"""The lightning indexer of the CSA layers: entry scores and the top-k selection without a sort.

The torch reference (:func:`ds4serve.model.attention._index_top`) converts the keys to fp32,
materialises the per-head scores ``[S, ih, T]`` in fp32 (a 1 GB tensor for a 2048-token prefill
chunk over 2048 entries) and selects with ``torch.topk``, a radix sort. Here two launches:

* :func:`index_scores`: one program per block of query rows and tile of entries multiplies the
  ``[rows*ih, dim]`` queries with a ``[dim, BLOCK_T]`` key tile on the tensor cores (fp32
  accumulation; bf16 products are exact in fp32, so only the summation order differs from the
  reference), applies relu and the head weights and sums the heads in registers: only the
  ``[S, T]`` fp32 scores reach memory, ``-inf`` where an entry is not visible. A tile with no
  visible entry reads no keys: the static decode buffer is sized for the longest context.
* :func:`select_top`: one program per query row finds the k-th largest score by a radix select on
  the order-preserving unsigned image of the fp32 bits, a ``bits``-wide digit per pass, most
  significant first (4 bits by default: 8 passes): each pass builds the histogram of the digit
  over the keys whose higher digits are those found so far, and its suffix sums give the digit of
  the k-th largest key and how many keys lie above it. The passes are sequential block-wide steps (a row
  is one program), so their number sets the kernel's latency on a decode row. Then it keeps every
  score above the k-th largest and, among the scores equal to it, the lowest entry indices until
  ``k`` are taken. ``torch.topk`` leaves the order among equal values unspecified, so this tie rule
  is as exact as the reference. A row with at most ``k`` finite scores keeps all of them without
  the radix passes, and the passes end after the row's last finite score.
  :func:`select_top_indices` runs the same kernel with an index output: the selected entries' indices
  in ascending order, ``[S, k]`` with -1 in the places a row leaves, so that the decode attention
  reads only those entries. Each selected entry's place is its rank among the row's selected ones (a
  prefix sum of the selection flags), so the indices are written without a sort.

Every row of every chunk size uses both kernels (decode, verify and prefill): the selection has no
host synchronisation and no value-dependent shape, so the static decode step can be captured in a
CUDA graph, and a prefill chunk's rows run in parallel, one program each.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl

_NEG_INF_KEY = tl.constexpr(0x007FFFFF)  # the key of -inf: below every finite score


@dataclass(frozen=True)
class ScoresConfig:
    block_s: int  # query rows per program (a power of two)
    block_t: int  # entries per program (a power of two, >= 16)
    warps: int = 4


@dataclass(frozen=True)
class SelectConfig:
    block: int = 1024  # scores read per step of a pass over the row
    # radix digit width, both paths: 32 // bits passes, each a 2**bits-bin histogram (4: the fastest of
    # bench/sweep_indexer.py for decode rows of 2048 and 8192 entries)
    bits: int = 4
    warps: int = 8
    # A row of up to this many scores (rounded up to a power of two) is read once into registers and
    # every pass runs there; a longer one is read again by each pass, ``block`` at a time.
    one_tile_max: int = 4096

    def __post_init__(self) -> None:
        if self.bits not in (1, 2, 4, 8):  # a digit must divide the 32 key bits; 2**8 bins at most
            raise ValueError(f"SelectConfig.bits must be 1, 2, 4 or 8, not {self.bits}")


@functools.cache
def default_scores_config(rows: int) -> ScoresConfig:
    """Decode / verify rows: narrow entry tiles, so that a 2048-entry buffer fills 128 programs;
    prefill chunks: two rows per program, so that each key tile is read once for 128 head rows
    (the fastest of ``bench/sweep_indexer.py``)."""
    return ScoresConfig(1, 16) if rows <= 8 else ScoresConfig(2, 64)


@triton.jit
def _scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    vis_ptr,
    out_ptr,
    S,
    T,
    IH,
    D,
    qk_scale,
    w_scale,
    sq_s,
    sq_h,
    sq_d,
    sk_t,
    sk_d,
    sw_s,
    sw_h,
    sv_s,
    sv_t,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
    IH_P: tl.constexpr,
    D_P: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    s0 = tl.program_id(0) * BLOCK_S
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_S * IH_P)  # (query row, head) pairs, heads fastest
    rs = s0 + r // IH_P
    rh = r % IH_P
    s = s0 + tl.arange(0, BLOCK_S)
    inside = (s[:, None] < S) & (t[None, :] < T)
    vis = tl.load(vis_ptr + s[:, None] * sv_s + t[None, :] * sv_t, mask=inside, other=0) != 0
    score = tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32)
    if (
        tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0
    ):  # a static decode buffer is mostly not visible yet
        rows_in = (rs < S) & (rh < IH)
        d = tl.arange(0, D_P)
        q = tl.load(
            q_ptr + rs[:, None] * sq_s + rh[:, None] * sq_h + d[None, :] * sq_d,
            mask=rows_in[:, None] & (d[None, :] < D),
            other=0.0,
        )
        kt = tl.load(
            k_ptr + t[None, :] * sk_t + d[:, None] * sk_d, mask=(t[None, :] < T) & (d[:, None] < D), other=0.0
        )
        if WIDEN:  # Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; fp32 is exact
            q = q.to(tl.float32)
            kt = kt.to(tl.float32)
        dots = tl.dot(q, kt, input_precision="ieee")  # [BLOCK_S*IH_P, BLOCK_T] fp32
        w = tl.load(w_ptr + rs * sw_s + rh * sw_h, mask=rows_in, other=0.0).to(tl.float32) * w_scale
        heads = tl.maximum(dots, 0.0) * qk_scale * w[:, None]
        score = tl.where(vis, tl.sum(tl.reshape(heads, [BLOCK_S, IH_P, BLOCK_T]), axis=1), float("-inf"))
    tl.store(out_ptr + s[:, None] * T + t[None, :], score, mask=inside)


def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    config: ScoresConfig | None = None,
) -> torch.Tensor:
    """fp32 ``[S, T]``: ``sum_h relu(q[s,h] . keys[t]) * dim^-0.5 * head_w[s,h] * ih^-0.5``, ``-inf``
    where ``visible [S, T]`` is False; ``q [S, ih, dim]`` and ``keys [T, dim]`` of one dtype."""
    S, ih, dim = q.shape
    T = keys.shape[0]
    cfg = config or default_scores_config(S)
    out = torch.empty(S, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(S, cfg.block_s), triton.cdiv(T, cfg.block_t))
    _scores_kernel[grid](
        q,
        keys,
        head_w,
        visible,
        out,
        S,
        T,
        ih,
        dim,
        dim**-0.5,
        ih**-0.5,
        *q.stride(),
        *keys.stride(),
        *head_w.stride(),
        *visible.stride(),
        BLOCK_S=cfg.block_s,
        BLOCK_T=cfg.block_t,
        IH_P=max(16, triton.next_power_of_2(ih)),
        D_P=max(16, triton.next_power_of_2(dim)),
        WIDEN=not q.is_cuda,
        num_warps=cfg.warps,
        **pdl.launch(q),
    )
    return out


@triton.jit
def _key(x):
    """Order-preserving uint32 image of fp32 ``x``; -0.0 and +0.0 get the same key."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: larger magnitude -> smaller signed integer
    return b.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _count_and_max(n0, m0, n1, m1):
    return n0 + n1, tl.maximum(m0, m1)


@triton.jit
def _digit_histogram(keys, prefix, found, shift, R: tl.constexpr):
    """``[R]`` counts of the digit ``(key >> shift) % R`` over the keys whose bits under ``found`` (the
    digits above this one) equal ``prefix``. The keys of -inf (masked entries, padding) are left out:
    the k-th largest is finite, and on the GPU each counted key is an atomic add to its bin in shared
    memory, which the many -inf keys of a partly visible row would all hit at once."""
    digit = ((keys >> shift) & (R - 1)).to(tl.int32)
    return tl.histogram(digit, R, mask=(keys != _NEG_INF_KEY) & ((keys & found) == prefix))


@triton.jit
def _kth_key(row_ptr, end, k, tile, BLOCK: tl.constexpr, BITS: tl.constexpr, ONE_TILE: tl.constexpr):
    """The largest key ``v`` with ``#(key >= v) >= k`` (the k-th largest) and how many of the keys
    equal to it are among the ``k`` largest, for a row of more than ``k`` finite scores, all before
    ``end``; built ``BITS`` bits a pass from the top. ``ONE_TILE``: the row's keys are ``tile`` (in
    registers), else each pass reads them again."""
    R: tl.constexpr = 1 << BITS
    offs = tl.arange(0, BLOCK)
    prefix = tl.full((), 0, tl.uint32)
    found = tl.full((), 0, tl.uint32)  # the bits of ``prefix`` set so far
    need = k  # how many of the keys that match ``prefix`` are still to be taken (at most their count)
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        if ONE_TILE:
            hist = _digit_histogram(tile, prefix, found, shift, R)
        else:
            hist = tl.zeros([R], tl.int32)
            for t0 in range(0, end, BLOCK):
                inside = t0 + offs < end
                u = _key(tl.load(row_ptr + t0 + offs, mask=inside, other=float("-inf")))
                hist += _digit_histogram(u, prefix, found, shift, R)
        at_least = tl.cumsum(hist, axis=0, reverse=True)  # [d]: matching keys with a digit >= d
        # at_least falls as d grows: the digit is the last d where it still reaches ``need``, and the
        # keys above that digit are at_least of the next d, the largest value below ``need``.
        reached, above = tl.reduce(
            ((at_least >= need).to(tl.int32), tl.where(at_least < need, at_least, 0)), 0, _count_and_max
        )
        prefix = prefix | ((reached - 1).to(tl.uint32) << shift)
        found = found | (tl.full((), R - 1, tl.uint32) << shift)
        need = need - above
    return prefix, need


@triton.jit
def _store_selection(dst, t0, sel, inside, kept, k, BLOCK: tl.constexpr, INDICES: tl.constexpr):
    """Store the selection ``sel`` of the entries ``t0 + [0, BLOCK)``: their flags at ``dst + t0``, or
    (``INDICES``) each selected entry's index at its place among the row's selected ones, ``kept`` of
    them in earlier tiles. Returns the count of selected entries so far (index mode). The place is
    checked against ``k``: a positive NaN score is not finite yet above every key, so it could overflow a row."""
    offs = t0 + tl.arange(0, BLOCK)
    if INDICES:
        place = kept + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(dst + place, offs, mask=sel & (place < k))
        kept += tl.sum(sel.to(tl.int32), axis=0)
    else:
        tl.store(dst + offs, sel, mask=inside)
    return kept


@triton.jit
def _pad_indices(dst, kept, k, BLOCK: tl.constexpr):
    """-1 at the places ``[kept, k)`` of an index row, after its selected entries."""
    offs = tl.arange(0, BLOCK)
    for j0 in range(kept, k, BLOCK):
        tl.store(dst + j0 + offs, tl.full([BLOCK], -1, tl.int32), mask=j0 + offs < k)


@triton.jit
def _select_kernel(
    score_ptr,
    out_ptr,
    T,
    k,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    ONE_TILE: tl.constexpr,
    INDICES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. Out: the bool mask ``[S, T]``, or (``INDICES``) int32 ``[S, k]``, the
    selected entries' indices in ascending order, then -1."""
    pdl.start(PDL)
    row_ptr = score_ptr + tl.program_id(0) * T
    dst = out_ptr + tl.program_id(0) * (k if INDICES else T)
    offs = tl.arange(0, BLOCK)
    if ONE_TILE:  # the whole row in registers: one read, then every pass over the keys there
        scores = tl.load(row_ptr + offs, mask=offs < T, other=float("-inf"))
        tile = _key(scores)
        finite = tl.sum((scores > float("-inf")).to(tl.int32), axis=0)
        end = T
    else:
        tile = tl.zeros([BLOCK], tl.uint32)
        finite = 0
        end = 0  # one past the last finite score: the passes stop there (decode: the context, not the buffer)
        for t0 in range(0, T, BLOCK):
            fin = tl.load(row_ptr + t0 + offs, mask=t0 + offs < T, other=float("-inf")) > float("-inf")
            finite += tl.sum(fin.to(tl.int32), axis=0)
            end = tl.maximum(end, tl.max(tl.where(fin, t0 + offs + 1, 0), axis=0))
    threshold = tl.full((), _NEG_INF_KEY, tl.uint32)
    quota = 0  # how many of the scores equal to the threshold to take
    if finite > k:
        threshold, quota = _kth_key(row_ptr, end, k, tile, BLOCK, BITS, ONE_TILE)
    kept = 0  # index mode: the entries selected so far
    if ONE_TILE:
        inside = offs < T
        tie = (tile == threshold) & inside
        rank = tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among the row's ties
        kept = _store_selection(
            dst, 0, (tile > threshold) | (tie & (rank <= quota)), inside, kept, k, BLOCK, INDICES
        )
    else:
        taken = 0
        for t0 in range(0, end, BLOCK):
            inside = t0 + offs < T
            u = _key(tl.load(row_ptr + t0 + offs, mask=inside, other=float("-inf")))
            tie = (u == threshold) & inside
            rank = tl.cumsum(tie.to(tl.int32), axis=0) + taken  # 1-based among this row's ties
            taken += tl.sum(tie.to(tl.int32), axis=0)
            kept = _store_selection(
                dst, t0, (u > threshold) | (tie & (rank <= quota)), inside, kept, k, BLOCK, INDICES
            )
        if not INDICES:
            for t0 in range(tl.cdiv(end, BLOCK) * BLOCK, T, BLOCK):
                tl.store(dst + t0 + offs, tl.zeros([BLOCK], tl.int1), mask=t0 + offs < T)
    if INDICES:
        _pad_indices(dst, kept, k, BLOCK)


def _select(scores: torch.Tensor, k: int, config: SelectConfig | None, indices: bool) -> torch.Tensor:
    cfg = config or SelectConfig()
    scores = scores.contiguous()
    S, T = scores.shape
    if indices:
        out = torch.empty(S, k, device=scores.device, dtype=torch.int32)
    else:
        out = torch.empty(S, T, device=scores.device, dtype=torch.bool)
    block = cfg.block
    if T > block and triton.next_power_of_2(T) <= cfg.one_tile_max:
        block = triton.next_power_of_2(T)
    _select_kernel[(S,)](
        scores,
        out,
        T,
        k,
        BLOCK=block,
        BITS=cfg.bits,
        ONE_TILE=T <= block,
        INDICES=indices,
        num_warps=cfg.warps,
        **pdl.launch(scores),
    )
    return out


def select_top(scores: torch.Tensor, k: int, config: SelectConfig | None = None) -> torch.Tensor:
    """bool ``[S, T]``: per row, the ``k`` largest finite scores (all finite ones when there are at
    most ``k``; among scores equal to the k-th largest, the lowest indices)."""
    return _select(scores, k, config, indices=False)


def select_top_indices(scores: torch.Tensor, k: int, config: SelectConfig | None = None) -> torch.Tensor:
    """int32 ``[S, k]``: per row, the indices of the entries :func:`select_top` marks, ascending, then
    -1 for the places left (a row of fewer than ``k`` finite scores), so that the decode attention
    reads only the selected entries."""
    return _select(scores, k, config, indices=True)


def index_top(
    q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, visible: torch.Tensor, k: int
) -> torch.Tensor:
    """The visible entries among the ``k`` best by indexer score, per query ``[S, T]`` (bool)."""
    return select_top(index_scores(q, keys, head_w, visible), k)


def index_top_indices(
    q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, visible: torch.Tensor, k: int
) -> torch.Tensor:
    """:func:`index_top` as indices: int32 ``[S, k]``, the selected entries ascending, then -1 (see
    :func:`select_top_indices`)."""
    return select_top_indices(index_scores(q, keys, head_w, visible), k)
