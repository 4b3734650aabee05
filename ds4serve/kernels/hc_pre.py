"""A whole mHC "pre" site of a decode step in one launch: mixes, coefficients, collapse, the sublayer's norm.

:func:`hc_pre` equals :func:`ds4serve.model.hyper.hc_split` then :func:`ds4serve.model.norms.rms_norm` on streams
``X [S, hc, D]``; :func:`hc_merge_pre` first merges a sublayer's output into the streams
(``hc_merge(X, out, post, comb)``), in the same launch. The output may also be the fused MoE's unsummed fp32 slot
terms ``[S, slots, D]``, which the merge sums in slot order and rounds to X's dtype as the MoE's slot sum would.

Grid ``(P + 1, S)``: program ``p < P`` of row ``s`` reads ``BLOCK`` values of the flattened row (merged first, and
stored, with the merge) and the same columns of ``fn`` (read before the PDL wait when ``fn`` is the caller's fp32
weight, which no kernel writes), stores its partial sum of squares and 24 partial dot products to an fp32 scratch
``[S, P, 1 + mix]`` and counts itself in on the row's arrival counter. The last program to arrive signals the row's
extra program ``P``, forms ``pre`` from the partials (summed in a fixed order: deterministic), collapses the streams
and applies the norm; program ``P`` meanwhile forms ``post`` and ``comb`` (the Sinkhorn iterations) and writes them.
The last-program pattern, its memory ordering and the shared counters: :mod:`ds4serve.kernels.arrival`. Two launches
must not run concurrently on one device (they share the counters).

Rounding follows the torch code up to fp32 summation order: the norm's factor multiplies each row's 24 sums instead
of its inputs; the collapse sums the ``hc`` streams in fp32, in stream order, and rounds to X's dtype; the norm takes
fp32 statistics of that rounded value and casts once; the merge rounds as ``hc_merge``'s product-sum branch
(:func:`ds4serve.kernels.hc_streams.merged`), launched without FP contraction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .arrival import counters, last_to_arrive, signal, wait_for
from .hc_streams import EXACT_ROUNDING, merged
from .hyper import coefficients, pre_coefficients

# Up to this many rows the model runs a site as this kernel (its rows run side by side): the widest verify block
# whose FP8 projections stay on the GEMV (model/linear.py FP8_GEMV_MAX_ROWS).
MAX_ROWS = 16
BLOCK = 128  # flattened-row values per program: P = 128 programs for hc * D = 16384
NUM_WARPS = 8  # halves each thread's share of the last program's collapse and norm (docs/KERNELS.md)


@triton.jit
def _hc_pre_kernel(
    x_ptr,
    out_ptr,
    post_in_ptr,
    comb_in_ptr,
    merged_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    w_ptr,
    part_ptr,
    count_ptr,
    flag_ptr,
    post_ptr,
    comb_ptr,
    y_ptr,
    D,
    iters,
    eps,
    norm_eps,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    MIX_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    MERGE: tl.constexpr,
    SLOTS: tl.constexpr,
    EARLY_FN: tl.constexpr,
    PDL: tl.constexpr,
):
    p = tl.program_id(0)
    n_prog = tl.num_programs(0) - 1  # each row's last program is its Sinkhorn program
    s = tl.program_id(1).to(tl.int64)
    if EARLY_FN:
        # fn is a weight, which no kernel before writes: its loads (the phase's trip to DRAM) can be issued before
        # the PDL wait, and their latency then overlaps the kernel before instead of following the wait
        f = _fn_columns(fn_ptr, p, D, HC, BLOCK, MIX_PAD)
    pdl.start(PDL)
    if not EARLY_FN:
        f = _fn_columns(fn_ptr, p, D, HC, BLOCK, MIX_PAD)
    WIDTH: tl.constexpr = 1 + (2 + HC) * HC
    if p == n_prog:
        wait_for(flag_ptr + s)
        _, post, comb = _row_coefficients(
            part_ptr + s * n_prog * WIDTH,
            n_prog,
            HC * D,
            base_ptr,
            scale_ptr,
            iters,
            eps,
            norm_eps,
            HC,
            P_PAD,
        )
        _store_post_comb(post_ptr, comb_ptr, s, post, comb, HC)
    else:
        _site_part(
            x_ptr,
            out_ptr,
            post_in_ptr,
            comb_in_ptr,
            merged_ptr,
            f,
            base_ptr,
            scale_ptr,
            w_ptr,
            part_ptr,
            count_ptr,
            flag_ptr,
            y_ptr,
            p,
            n_prog,
            s,
            D,
            eps,
            norm_eps,
            HC,
            BLOCK,
            MIX_PAD,
            P_PAD,
            D_PAD,
            MERGE,
            SLOTS,
        )


@triton.jit
def _fn_columns(fn_ptr, p, D, HC: tl.constexpr, BLOCK: tl.constexpr, MIX_PAD: tl.constexpr):
    """``fn [mix, HC * D]`` at program ``p``'s ``BLOCK`` columns, ``[MIX_PAD, BLOCK]`` fp32 (zeros past the ends; none
    at all for a row's Sinkhorn program, whose columns lie past the row)."""
    MIX: tl.constexpr = (2 + HC) * HC
    n = p * BLOCK + tl.arange(0, BLOCK)
    m = tl.arange(0, MIX_PAD)
    return tl.load(
        fn_ptr + m[:, None] * (HC * D) + n[None, :],
        mask=(m[:, None] < MIX) & (n < HC * D)[None, :],
        other=0.0,
    )


@triton.jit
def _store_post_comb(post_ptr, comb_ptr, s, post, comb, HC: tl.constexpr):
    j = tl.arange(0, HC)
    tl.store(post_ptr + s * HC + j, post)
    tl.store(comb_ptr + s * HC * HC + j[:, None] * HC + j[None, :], comb)


@triton.jit
def _site_part(
    x_ptr,
    out_ptr,
    post_in_ptr,
    comb_in_ptr,
    merged_ptr,
    f,
    base_ptr,
    scale_ptr,
    w_ptr,
    part_ptr,
    count_ptr,
    flag_ptr,
    y_ptr,
    p,
    n_prog,
    s,
    D,
    eps,
    norm_eps,
    HC: tl.constexpr,
    BLOCK: tl.constexpr,
    MIX_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    MERGE: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """Program ``p`` of row ``s``: its ``BLOCK`` values' partials with ``f``, its columns of ``fn`` (merged first
    with ``MERGE``); the last of the row to arrive finishes the row: it signals the row's Sinkhorn program and
    computes only ``pre``, then it collapses the streams and applies the norm."""
    MIX: tl.constexpr = (2 + HC) * HC
    WIDTH: tl.constexpr = 1 + MIX
    N = HC * D
    n = p * BLOCK + tl.arange(0, BLOCK)
    nm = n < N
    if MERGE:
        # n = k * D + d; k clamped so that the masked tail of the last program reads comb and post in bounds
        d = n % D
        o = _sublayer_output(out_ptr, x_ptr, s, d, nm, D, SLOTS)
        x = merged(
            x_ptr + s * N,
            o,
            post_in_ptr + s * HC,
            comb_in_ptr + s * HC * HC,
            tl.minimum(n // D, HC - 1),
            d,
            nm,
            D,
            HC,
            BLOCK,
        )
        site_row = merged_ptr + s * N
        tl.store(site_row + n, x, mask=nm)
    else:
        site_row = x_ptr + s * N
        x = tl.load(site_row + n, mask=nm, other=0.0)
    x = x.to(tl.float32)
    m = tl.arange(0, MIX_PAD)
    part = part_ptr + (s * n_prog + p) * WIDTH
    tl.store(part, tl.sum(x * x, axis=0))
    tl.store(part + 1 + m, tl.sum(f * x[None, :], axis=1), mask=m < MIX)
    if last_to_arrive(count_ptr + s, n_prog):
        signal(flag_ptr + s)
        # The collapse's rows and the norm weight do not depend on the coefficients: loaded first, their
        # latency overlaps the partials' loads and any Sinkhorn math instead of following them.
        rows, w = _collapse_inputs(site_row, w_ptr, D, HC, D_PAD)
        partials = part_ptr + s * n_prog * WIDTH
        pre = _row_pre(partials, n_prog, N, base_ptr, scale_ptr, eps, norm_eps, HC, P_PAD)
        _collapse_and_norm(rows, w, pre, y_ptr + s * D, D, norm_eps, HC, D_PAD)


@triton.jit
def _sublayer_output(out_ptr, x_ptr, s, d, mask, D, SLOTS: tl.constexpr):
    """Row ``s`` of the sublayer output at columns ``d``, as fp32 values: read as stored (``SLOTS == 0``), or
    summed from its fp32 slot terms ``[S, SLOTS, D]`` (the fused MoE's, left unsummed) in slot order and
    rounded to X's dtype, as the MoE's own slot-sum launch would have stored it."""
    if SLOTS == 0:
        return tl.load(out_ptr + s * D + d, mask=mask, other=0.0).to(tl.float32)
    row = out_ptr + s * SLOTS * D + d
    acc = tl.load(row, mask=mask, other=0.0)
    for j in tl.static_range(1, SLOTS):
        acc += tl.load(row + j * D, mask=mask, other=0.0)
    return acc.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _row_pre(rows_ptr, n_prog, N, base_ptr, scale_ptr, eps, norm_eps, HC: tl.constexpr, P_PAD: tl.constexpr):
    """``pre`` of a row from its programs' partials, as :func:`_row_coefficients` computes it."""
    _, _, sq, pre_w = _row_partials(rows_ptr, n_prog, HC, P_PAD)
    r = tl.rsqrt(tl.sum(sq, axis=0) / N + norm_eps)
    return pre_coefficients(tl.sum(pre_w, axis=0) * r, base_ptr, scale_ptr, eps, HC)


@triton.jit
def _row_coefficients(
    rows_ptr, n_prog, N, base_ptr, scale_ptr, iters, eps, norm_eps, HC: tl.constexpr, P_PAD: tl.constexpr
):
    """``(pre, post, comb)`` of a row from its programs' partials ``[n_prog, 1 + mix]`` at ``rows_ptr``."""
    rows, pm, sq, pre_w = _row_partials(rows_ptr, n_prog, HC, P_PAD)
    j = tl.arange(0, HC)
    post_w = tl.load(rows[:, None] + 1 + HC + j[None, :], mask=pm[:, None], other=0.0, cache_modifier=".cg")
    cell = j[:, None] * HC + j[None, :]
    comb_w = tl.load(
        rows[:, None, None] + 1 + 2 * HC + cell[None, :, :],
        mask=pm[:, None, None],
        other=0.0,
        cache_modifier=".cg",
    )
    r = tl.rsqrt(tl.sum(sq, axis=0) / N + norm_eps)
    return coefficients(
        tl.sum(pre_w, axis=0) * r,
        tl.sum(post_w, axis=0) * r,
        tl.sum(comb_w, axis=0) * r,
        base_ptr,
        scale_ptr,
        iters,
        eps,
        HC,
    )


@triton.jit
def _row_partials(rows_ptr, n_prog, HC: tl.constexpr, P_PAD: tl.constexpr):
    """``(the partials' row pointers [P_PAD], their mask, the squares' partials [P_PAD], the pre mixes' [P_PAD, HC])``
    of a row, loaded at L2 (other programs wrote them)."""
    WIDTH: tl.constexpr = 1 + (2 + HC) * HC
    q = tl.arange(0, P_PAD)
    j = tl.arange(0, HC)
    rows = rows_ptr + q * WIDTH
    pm = q < n_prog
    sq = tl.load(rows, mask=pm, other=0.0, cache_modifier=".cg")
    pre_w = tl.load(rows[:, None] + 1 + j[None, :], mask=pm[:, None], other=0.0, cache_modifier=".cg")
    return rows, pm, sq, pre_w


@triton.jit
def _collapse_inputs(site_row, w_ptr, D, HC: tl.constexpr, D_PAD: tl.constexpr):
    """``(rows, w)``: the tuple of the row's ``HC`` streams ``[D_PAD]`` and the norm weight. The streams are
    read at L2 (``.cg``): with the merge, other programs of the launch wrote them (see the partials)."""
    d = tl.arange(0, D_PAD)
    dm = d < D
    rows = ()
    for k in tl.static_range(HC):
        rows = rows + (tl.load(site_row + k * D + d, mask=dm, other=0.0, cache_modifier=".cg"),)
    return rows, tl.load(w_ptr + d, mask=dm, other=0.0)


@triton.jit
def _collapse_and_norm(rows, w, pre, y_ptr, D, norm_eps, HC: tl.constexpr, D_PAD: tl.constexpr):
    """``y = sum_k pre_k X_k`` (fp32, in stream order, rounded to the output dtype), then
    ``w * (y * rsqrt(mean(y^2) + eps))``."""
    j = tl.arange(0, HC)
    d = tl.arange(0, D_PAD)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for k in tl.static_range(HC):
        acc += tl.sum(tl.where(j == k, pre, 0.0), axis=0) * rows[k].to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)
    y = y * tl.rsqrt(tl.sum(y * y, axis=0) / D + norm_eps)
    tl.store(y_ptr + d, (w * y).to(dtype), mask=d < D)


def hc_pre(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    norm_eps: float,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(post [S, hc] fp32, comb [S, hc, hc] fp32, x_in [S, D] in X's dtype)`` for streams ``X [S, hc, D]``:
    ``hc_split(X, HCSite(fn, base, scale), ...)`` then ``rms_norm(collapsed, norm_w, norm_eps)``.

    ``fn [(2+hc)*hc, hc*D]``, ``base [(2+hc)*hc]``, ``scale [3]`` and ``norm_w [D]`` are used in fp32; ``fn`` is a
    weight (an fp32 one is read before the launch's PDL wait, so the kernel just before must not write it).
    Two launches must not run concurrently on one device (they share the arrival counters).
    """
    return _site(X, None, fn, base, scale, norm_w, hc, iters, eps, norm_eps, block)[1:]


def hc_merge_pre(
    X: torch.Tensor,
    out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    norm_eps: float,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(X' [S, hc, D], post' [S, hc], comb' [S, hc, hc], x_in [S, D])``: the merge
    ``X' = hc_merge(X, out, post, comb)`` of a sublayer's output ``out [S, D]`` (fp32 ``post``, ``comb``),
    then the next pre site on ``X'`` as :func:`hc_pre` (same arguments), in one launch. ``out`` may also be
    the fp32 slot terms ``[S, slots, D]`` of the fused MoE: the kernel sums them as the MoE would have."""
    terms = out.dim() == 3
    merge = (
        (out.float() if terms else out.to(X.dtype)).contiguous(),
        post.float().contiguous(),
        comb.float().contiguous(),
    )
    return _site(X, merge, fn, base, scale, norm_w, hc, iters, eps, norm_eps, block)


def _site(
    X: torch.Tensor,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
    norm_eps: float,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch of the kernel: ``(the site's streams, post, comb, x_in)``, the streams ``X`` itself, or
    the merged ones when ``merge`` is ``(out, post, comb)``."""
    S, _, D = X.shape
    X = X.contiguous()
    mix = (2 + hc) * hc
    n_prog = triton.cdiv(hc * D, block)
    fn32 = fn.float().contiguous()
    # read before the PDL wait only when it is the caller's weight: a converted copy is the launch before's output
    early_fn = fn32 is fn
    part = torch.empty(S, n_prog, 1 + mix, device=X.device, dtype=torch.float32)
    flags = counters(X.device, 2 * S)
    post = torch.empty(S, hc, device=X.device, dtype=torch.float32)
    comb = torch.empty(S, hc, hc, device=X.device, dtype=torch.float32)
    x_in = torch.empty(S, D, device=X.device, dtype=X.dtype)
    streams = X if merge is None else torch.empty_like(X)
    out, post_in, comb_in = (X, X, X) if merge is None else merge  # unread without the merge
    slots = out.shape[1] if merge is not None and out.dim() == 3 else 0
    _hc_pre_kernel[(n_prog + 1, S)](  # one more program a row: its Sinkhorn program
        X,
        out,
        post_in,
        comb_in,
        streams,
        fn32,
        base.float().contiguous(),
        scale.float().contiguous(),
        norm_w.float().contiguous(),
        part,
        flags,
        flags[S:],
        post,
        comb,
        x_in,
        D,
        iters,
        eps,
        norm_eps,
        HC=hc,
        BLOCK=block,
        MIX_PAD=triton.next_power_of_2(mix),
        P_PAD=triton.next_power_of_2(n_prog),
        D_PAD=triton.next_power_of_2(D),
        MERGE=merge is not None,
        SLOTS=slots,
        EARLY_FN=early_fn,
        num_warps=NUM_WARPS,
        **EXACT_ROUNDING,
        **pdl.launch(X),
    )
    return streams, post, comb, x_in
