"""The lightning indexer of the CSA layers: entry scores and the top-k selection without a sort.

The torch reference (:func:`ds4serve.model.attention._index_top`) converts the keys to fp32,
materialises the per-head scores ``[S, ih, T]`` in fp32 (a 1 GB tensor for a 2048-token prefill
chunk over 2048 entries) and selects with ``torch.topk``, a radix sort. Here two launches:

* :func:`index_scores`: one program per block of query rows and tile of entries reads the
  ``[BLOCK_T, dim]`` key tile once and, for each of its rows, multiplies it with the row's
  ``[dim, ih]`` queries on the tensor cores (fp32 accumulation; bf16 products are exact in fp32, so
  only the summation order differs from the reference), applies relu and the head weights and sums
  the heads along the accumulator's rows in registers: only the ``[S, T]`` fp32 scores reach memory,
  ``-inf`` where an entry is not visible. A tile no row of the block sees reads no keys: the static
  decode buffer is sized for the longest context. A row's scores do not depend on the block it shares.
* :func:`select_top`: finds each row's k-th largest score by a radix select on the order-preserving
  unsigned image of the fp32 bits, a ``bits``-wide digit per pass, most significant first: each pass
  builds the histogram of the digit over the keys whose higher digits are those found so far, and its
  suffix sums give the digit of the k-th largest key and how many keys lie above it. Then it keeps
  every score above the k-th largest and, among the scores equal to it, the lowest entry indices until
  ``k`` are taken. ``torch.topk`` leaves the order among equal values unspecified, so this tie rule is
  as exact as the reference. A row with at most ``k`` finite scores keeps all of them without the
  radix passes. A row of up to ``SelectConfig.tile`` scores is one program, read once into registers,
  its passes sequential block-wide steps (4-bit digits: 8 passes). A longer row (a decode row past a
  8K context) is split into tiles, one program each, so that a million-token context's 262,144 scores
  are read by many SMs rather than one: a launch per pass (8-bit digits: 4 launches) adds each tile's
  histogram to the row's with integer atomics (exact in any order), every program derives the pass's
  digits from the row's histograms, and two more launches count each tile's keys above and at the
  threshold and write the selection after the tiles before it.
  :func:`select_top_indices` runs the same kernels with an index output: the selected entries' indices
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
    # A row of up to ``tile`` scores (rounded up to a power of two) is one program's, read once into
    # registers; a longer row is split into tiles of ``tile`` scores, one program each, a launch per
    # radix pass (a decode row of a million-token context has 262,144 scores). 2048: the fastest of
    # bench/sweep_indexer.py on decode rows of 32,768 and 262,144 scores (21 and 23 us, 4096: 26 and 27).
    tile: int = 2048
    # radix digit width of a one-program row: 32 // bits passes, each a 2**bits-bin histogram (4: the
    # fastest of bench/sweep_indexer.py for a decode row of 2048 entries)
    bits: int = 4
    # radix digit width of a split row: each pass is a launch, each program adds its histogram to the row's
    split_bits: int = 8
    warps: int = 8

    def __post_init__(self) -> None:
        for name in ("bits", "split_bits"):  # a digit must divide the 32 key bits; 2**8 bins at most
            if getattr(self, name) not in (1, 2, 4, 8):
                raise ValueError(f"SelectConfig.{name} must be 1, 2, 4 or 8, not {getattr(self, name)}")


@functools.cache
def default_select_config(rows: int) -> SelectConfig:
    """Decode / verify rows: the defaults (2048-score tiles, 8 warps); prefill chunks, whose rows fill the GPU
    without splitting: 4096-score tiles of 4 warps (a 2048-row chunk over 32,768 entries: 1.89 ms against
    2.49 with the decode tiles and 1.73 with the former one program a row;
    ``bench/results/2026-12-03-h200-long-context-decode.log``). The selection is the same either way."""
    return SelectConfig() if rows <= 8 else SelectConfig(tile=4096, warps=4)


@functools.cache
def default_scores_config(rows: int, entries: int) -> ScoresConfig:
    """Decode / verify rows: 64-entry tiles up to 8192 entries, 128-entry tiles of 8 warps past that;
    prefill chunks: 16 rows per program, each 128-entry key tile read once for them (the fastest of
    ``bench/sweep_indexer.py``, ``bench/results/2026-12-04-h200-sweep-indexer.log``). A row's scores
    depend on the buffer, never on the other rows."""
    if rows > 8:
        return ScoresConfig(16, 128, 8)
    return ScoresConfig(1, 64) if entries <= 8192 else ScoresConfig(1, 128, 8)


@triton.jit
def _row_queries(q_ptr, s, sq_s, sq_h, sq_d, h, d, IH, D, WIDEN: tl.constexpr):
    """Row ``s``'s queries ``[IH_P, D_P]`` (0 past ``IH`` heads and ``D`` dims)."""
    q = tl.load(
        q_ptr + s * sq_s + h[:, None] * sq_h + d[None, :] * sq_d,
        mask=(h[:, None] < IH) & (d[None, :] < D),
        other=0.0,
    )
    if WIDEN:  # Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; fp32 is exact
        q = q.to(tl.float32)
    return q


@triton.jit
def _scores_kernel(
    q_ptr,
    k_ptr,
    w_ptr,
    vis_ptr,
    open_ptr,
    open_at_ptr,
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
    OPEN: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    s0 = tl.program_id(0) * BLOCK_S
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    rows = s0 + tl.arange(0, BLOCK_S)
    d = tl.arange(0, D_P)
    h = tl.arange(0, IH_P)
    block_vis = tl.load(
        vis_ptr + rows[:, None] * sv_s + t[None, :] * sv_t, mask=(rows[:, None] < S) & tm[None, :], other=0
    )
    if (
        tl.max(tl.max(block_vis.to(tl.int32), axis=1), axis=0) > 0
    ):  # a static decode buffer is mostly not visible yet
        if BLOCK_S == 1:  # a decode row: its queries load beside the key tile, not after it
            q_row = _row_queries(q_ptr, s0.to(tl.int64), sq_s, sq_h, sq_d, h, d, IH, D, WIDEN)
        keys = tl.load(
            k_ptr + t[:, None] * sk_t + d[None, :] * sk_d, mask=tm[:, None] & (d[None, :] < D), other=0.0
        )
        if OPEN:  # the open window's entry, which the step holds apart from the buffer
            at = tl.load(open_at_ptr)
            if (at >= tl.program_id(1) * BLOCK_T) & (at < (tl.program_id(1) + 1) * BLOCK_T):  # in this tile
                row = tl.load(open_ptr + d, mask=d < D, other=0.0)
                keys = tl.where((t == at)[:, None], row[None, :], keys)
        if WIDEN:  # Triton's interpreter multiplies bf16 tiles as their raw 16-bit patterns; fp32 is exact
            keys = keys.to(tl.float32)
        wide = tl.full((), 0, tl.int64)  # s * T + t is 2**31 - 1 at a chunk of 8192 rows over 262,144 entries
        # the key tile is read once for the block's rows
        for row_at in range(s0, tl.minimum(s0 + BLOCK_S, S)):
            s = row_at + wide
            if BLOCK_S == 1:
                q = q_row
            else:
                q = _row_queries(q_ptr, s, sq_s, sq_h, sq_d, h, d, IH, D, WIDEN)
            dots = tl.dot(keys, tl.trans(q), input_precision="ieee")  # [BLOCK_T, IH_P] fp32
            w = tl.load(w_ptr + s * sw_s + h * sw_h, mask=h < IH, other=0.0).to(tl.float32) * w_scale
            score = tl.sum(tl.maximum(dots, 0.0) * qk_scale * w[None, :], axis=1)
            vis = tl.load(vis_ptr + s * sv_s + t * sv_t, mask=tm, other=0) != 0
            tl.store(out_ptr + s * T + t, tl.where(vis, score, float("-inf")), mask=tm)
    else:
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * T + t[None, :],
            tl.full([BLOCK_S, BLOCK_T], float("-inf"), tl.float32),
            mask=(rows[:, None] < S) & tm[None, :],
        )


def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    config: ScoresConfig | None = None,
    open_entry: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """fp32 ``[S, T]``: ``sum_h relu(q[s,h] . keys[t]) * dim^-0.5 * head_w[s,h] * ih^-0.5``, ``-inf``
    where ``visible [S, T]`` is False; ``q [S, ih, dim]`` and ``keys [T, dim]`` of one dtype. ``open_entry``
    (row ``[1, dim]``, slot ``[1]``): the key at the slot is read from the row (a one-token step's entry of
    the window it is in, which the step does not write into the buffer)."""
    S, ih, dim = q.shape
    T = keys.shape[0]
    cfg = config or default_scores_config(S, T)
    open_row, open_at = open_entry if open_entry is not None else (keys, keys)
    out = torch.empty(S, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(S, cfg.block_s), triton.cdiv(T, cfg.block_t))
    _scores_kernel[grid](
        q,
        keys,
        head_w,
        visible,
        open_row,
        open_at,
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
        OPEN=open_entry is not None,
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
def _next_digit(hist, prefix, found, need, shift, R: tl.constexpr):
    """One radix pass's step: from the histogram ``[R]`` of the digit at ``shift`` over the keys that
    match ``prefix``, the digit of the k-th largest (appended to ``prefix`` and ``found``) and how many of
    the keys that match the longer prefix are still to be taken."""
    at_least = tl.cumsum(hist, axis=0, reverse=True)  # [d]: matching keys with a digit >= d
    # at_least falls as d grows: the digit is the last d where it still reaches ``need``, and the
    # keys above that digit are at_least of the next d, the largest value below ``need``.
    reached, above = tl.reduce(
        ((at_least >= need).to(tl.int32), tl.where(at_least < need, at_least, 0)), 0, _count_and_max
    )
    prefix = prefix | ((reached - 1).to(tl.uint32) << shift)
    found = found | (tl.full((), R - 1, tl.uint32) << shift)
    return prefix, found, need - above


@triton.jit
def _kth_key(keys, k, BITS: tl.constexpr):
    """The largest key ``v`` with ``#(key >= v) >= k`` (the k-th largest) among ``keys`` (one row in
    registers, more than ``k`` of them finite) and how many of the keys equal to it are among the ``k``
    largest; built ``BITS`` bits a pass from the top."""
    R: tl.constexpr = 1 << BITS
    prefix = tl.full((), 0, tl.uint32)
    found = tl.full((), 0, tl.uint32)  # the bits of ``prefix`` set so far
    need = k  # how many of the keys that match ``prefix`` are still to be taken (at most their count)
    for p in tl.static_range(32 // BITS):
        shift = 32 - BITS * (p + 1)
        hist = _digit_histogram(keys, prefix, found, shift, R)
        prefix, found, need = _next_digit(hist, prefix, found, need, shift, R)
    return prefix, need


@triton.jit
def _store_selection(dst, t0, sel, inside, kept, k, BLOCK: tl.constexpr, INDICES: tl.constexpr):
    """Store the selection ``sel`` of the entries ``t0 + [0, BLOCK)``: their flags at ``dst + t0``, or
    (``INDICES``) each selected entry's index at its place among the row's selected ones, ``kept`` of
    them in earlier tiles. Returns the count of selected entries so far (index mode). The place is
    checked against ``k``: a positive NaN score is above every key, so a row could hold more than ``k``."""
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
    INDICES: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program, read once (``T <= BLOCK``). Out: the bool mask ``[S, T]``, or (``INDICES``)
    int32 ``[S, k]``, the selected entries' indices in ascending order, then -1."""
    pdl.start(PDL)
    dst = out_ptr + tl.program_id(0) * (k if INDICES else T)
    offs = tl.arange(0, BLOCK)
    inside = offs < T
    keys = _key(tl.load(score_ptr + tl.program_id(0) * T + offs, mask=inside, other=float("-inf")))
    threshold = tl.full((), _NEG_INF_KEY, tl.uint32)
    quota = 0  # how many of the keys equal to the threshold to take
    if tl.sum((keys != _NEG_INF_KEY).to(tl.int32), axis=0) > k:
        threshold, quota = _kth_key(keys, k, BITS)
    tie = (keys == threshold) & inside
    rank = tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among the row's ties
    kept = _store_selection(
        dst, 0, (keys > threshold) | (tie & (rank <= quota)), inside, 0, k, BLOCK, INDICES
    )
    if INDICES:
        _pad_indices(dst, kept, k, BLOCK)


@triton.jit
def _split_state(hist_row, k, PASSES: tl.constexpr, BITS: tl.constexpr):
    """A split row after ``PASSES`` radix passes, from their histograms at ``hist_row`` (``[passes, R]``):
    the prefix of the k-th largest key, its bits, how many keys matching it are still to be taken, and
    whether the row has more than ``k`` finite scores (pass 0 counts every finite key). Every program of
    the row computes the same values from the same histograms."""
    R: tl.constexpr = 1 << BITS
    bins = tl.arange(0, R)
    prefix = tl.full((), 0, tl.uint32)
    found = tl.full((), 0, tl.uint32)
    need = k
    selective = True
    if PASSES > 0:
        selective = tl.sum(tl.load(hist_row + bins), axis=0) > k
    for p in tl.static_range(PASSES):
        shift = 32 - BITS * (p + 1)
        prefix, found, need = _next_digit(tl.load(hist_row + p * R + bins), prefix, found, need, shift, R)
    return prefix, found, need, selective


@triton.jit
def _split_keys(score_ptr, T, TILE: tl.constexpr):
    """This program's tile of its row: the keys, where they lie, and which are inside the row."""
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = offs < T
    return _key(tl.load(score_ptr + tl.program_id(0) * T + offs, mask=inside, other=float("-inf"))), inside


@triton.jit
def _split_hist_kernel(
    score_ptr, hist_ptr, T, k, PASS: tl.constexpr, TILE: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr
):
    """Radix pass ``PASS`` of a split row: this tile's histogram of the digit, added to the row's."""
    pdl.start(PDL)
    R: tl.constexpr = 1 << BITS
    hist_row = hist_ptr + tl.program_id(0) * (32 // BITS) * R
    prefix, found, need, selective = _split_state(hist_row, k, PASS, BITS)
    if selective:
        keys, _ = _split_keys(score_ptr, T, TILE)
        hist = _digit_histogram(keys, prefix, found, 32 - BITS * (PASS + 1), R)
        tl.atomic_add(hist_row + PASS * R + tl.arange(0, R), hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _split_threshold(hist_ptr, k, BITS: tl.constexpr):
    """The k-th largest key of this program's row and how many keys equal to it to take (every finite key
    of a row of at most ``k``: the key of -inf, none of them)."""
    R: tl.constexpr = 1 << BITS
    threshold, _, quota, selective = _split_state(
        hist_ptr + tl.program_id(0) * (32 // BITS) * R, k, 32 // BITS, BITS
    )
    if not selective:
        threshold = tl.full((), _NEG_INF_KEY, tl.uint32)
        quota = 0
    return threshold, quota


@triton.jit
def _split_count_kernel(
    score_ptr, hist_ptr, count_ptr, T, k, TILE: tl.constexpr, BITS: tl.constexpr, PDL: tl.constexpr
):
    """Per tile of a split row: how many of its keys are above the threshold and how many equal it."""
    pdl.start(PDL)
    threshold, _ = _split_threshold(hist_ptr, k, BITS)
    keys, inside = _split_keys(score_ptr, T, TILE)
    at = count_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 2
    tl.store(at, tl.sum((keys > threshold).to(tl.int32), axis=0))
    tl.store(at + 1, tl.sum(((keys == threshold) & inside).to(tl.int32), axis=0))


@triton.jit
def _split_write_kernel(
    score_ptr,
    hist_ptr,
    count_ptr,
    out_ptr,
    T,
    k,
    TILE: tl.constexpr,
    TILES_P: tl.constexpr,
    BITS: tl.constexpr,
    INDICES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per tile of a split row: its selection, placed after what the tiles before it selected."""
    pdl.start(PDL)
    threshold, quota = _split_threshold(hist_ptr, k, BITS)
    keys, inside = _split_keys(score_ptr, T, TILE)
    c = tl.program_id(1)
    tiles = tl.arange(0, TILES_P)
    row_counts = count_ptr + tl.program_id(0) * tl.num_programs(1) * 2 + tiles * 2
    before = tiles < c
    above = tl.sum(tl.load(row_counts, mask=before, other=0), axis=0)
    ties = tl.sum(tl.load(row_counts + 1, mask=before, other=0), axis=0)
    tie = (keys == threshold) & inside
    rank = ties + tl.cumsum(tie.to(tl.int32), axis=0)  # 1-based among the row's ties
    sel = (keys > threshold) | (tie & (rank <= quota))
    dst = out_ptr + tl.program_id(0) * (k if INDICES else T)
    kept = _store_selection(dst, c * TILE, sel, inside, above + tl.minimum(ties, quota), k, TILE, INDICES)
    if INDICES and c == tl.num_programs(1) - 1:
        _pad_indices(dst, kept, k, TILE)


def _select(scores: torch.Tensor, k: int, config: SelectConfig | None, indices: bool) -> torch.Tensor:
    scores = scores.contiguous()
    S, T = scores.shape
    cfg = config or default_select_config(S)
    if indices:
        out = torch.empty(S, k, device=scores.device, dtype=torch.int32)
    else:
        out = torch.empty(S, T, device=scores.device, dtype=torch.bool)
    launch = dict(num_warps=cfg.warps, **pdl.launch(scores))
    if T <= cfg.tile:
        block = max(16, triton.next_power_of_2(T))
        _select_kernel[(S,)](scores, out, T, k, BLOCK=block, BITS=cfg.bits, INDICES=indices, **launch)
        return out
    bits, tile = cfg.split_bits, cfg.tile
    tiles = triton.cdiv(T, tile)
    hist = torch.zeros(S, 32 // bits, 1 << bits, device=scores.device, dtype=torch.int32)
    counts = torch.empty(S, tiles, 2, device=scores.device, dtype=torch.int32)
    grid = (S, tiles)
    for p in range(32 // bits):
        _split_hist_kernel[grid](scores, hist, T, k, PASS=p, TILE=tile, BITS=bits, **launch)
    _split_count_kernel[grid](scores, hist, counts, T, k, TILE=tile, BITS=bits, **launch)
    _split_write_kernel[grid](
        scores,
        hist,
        counts,
        out,
        T,
        k,
        TILE=tile,
        TILES_P=triton.next_power_of_2(tiles),
        BITS=bits,
        INDICES=indices,
        **launch,
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
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """The visible entries among the ``k`` best by indexer score, per query ``[S, T]`` (bool)."""
    return select_top(index_scores(q, keys, head_w, visible), k)


def index_top_indices(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    open_entry: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`index_top` as indices: int32 ``[S, k]``, the selected entries ascending, then -1 (see
    :func:`select_top_indices`)."""
    return select_top_indices(index_scores(q, keys, head_w, visible, open_entry=open_entry), k)
