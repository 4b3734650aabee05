"""The hand-written kernels as torch operators, so that compiled regions can span them.

``torch.compile`` traces a ``torch.library`` custom op as one opaque node whose output shapes come
from its fake implementation. With the kernels behind these ops, a compiled region can hold a whole
decoder block (a static step's): the GEMVs, the fused MoE and the mHC Sinkhorn stay
hand-written launches, and Inductor fuses every elementwise chain between them. Outside compiled
code an op call is the launcher plus one dispatcher hop.
"""

from __future__ import annotations

import torch

from . import hyper, indexer, moe, router
from .attention_inputs import attention_inputs as _attention_inputs
from .decode_attention import decode_attention as _decode_attention
from .gemv import gemv as _gemv
from .gemv import gemv_pair as _gemv_pair
from .hc_pre import hc_merge_pre as _hc_merge_pre
from .hc_pre import hc_pre as _hc_pre

_LIB = "ds4serve"


def _block(scale: torch.Tensor | None, rows: int, cols: int) -> tuple[int, int] | None:
    """An FP8 weight's scale block as the GEMV launchers take it (None for a dense weight)."""
    return None if scale is None else (rows, cols)


@torch.library.custom_op(f"{_LIB}::gemv", mutates_args=())
def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block_rows: int,
    block_cols: int,
    groups: int,
) -> torch.Tensor:
    """:func:`ds4serve.kernels.gemv.gemv` (``[N, R]`` for ``x [N, K]`` or ``[N, G, K]``): ``weight`` FP8
    with its block scales, or dense with ``scale`` None (the block sizes are then ignored)."""
    return _gemv(x, weight, scale, _block(scale, block_rows, block_cols), groups)


@gemv.register_fake
def _(x, weight, scale, block_rows, block_cols, groups):
    return x.new_empty(x.numel() // (groups * weight.shape[1]), weight.shape[0])


@torch.library.custom_op(f"{_LIB}::gemv_pair", mutates_args=())
def gemv_pair(
    x: torch.Tensor,
    weight_a: torch.Tensor,
    scale_a: torch.Tensor | None,
    block_a_rows: int,
    block_a_cols: int,
    weight_b: torch.Tensor,
    scale_b: torch.Tensor | None,
    block_b_rows: int,
    block_b_cols: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ds4serve.kernels.gemv.gemv_pair`: two products of ``x [N, K]``, each weight FP8 with its
    block scales or dense (scale None)."""
    return _gemv_pair(
        x,
        (weight_a, scale_a, _block(scale_a, block_a_rows, block_a_cols)),
        (weight_b, scale_b, _block(scale_b, block_b_rows, block_b_cols)),
    )


@gemv_pair.register_fake
def _(x, weight_a, scale_a, block_a_rows, block_a_cols, weight_b, scale_b, block_b_rows, block_b_cols):
    n = x.numel() // weight_a.shape[1]
    return x.new_empty(n, weight_a.shape[0]), x.new_empty(n, weight_b.shape[0])


@torch.library.custom_op(f"{_LIB}::hc_coefficients", mutates_args=())
def hc_coefficients(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ds4serve.kernels.hyper.hc_coefficients`: ``(pre, post, comb)`` in fp32."""
    return hyper.hc_coefficients(mixes, base, scale, hc, iters, eps)


@hc_coefficients.register_fake
def _(mixes, base, scale, hc, iters, eps):
    S = mixes.shape[0]
    pre = mixes.new_empty(S, hc, dtype=torch.float32)
    return pre, torch.empty_like(pre), mixes.new_empty(S, hc, hc, dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::hc_pre", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ds4serve.kernels.hc_pre.hc_pre`: a whole mHC pre site, ``(post, comb)`` in fp32 and the
    sublayer's normed input ``[S, D]`` in X's dtype (the arrival counters it uses are left zero)."""
    return _hc_pre(X, fn, base, scale, norm_w, hc, iters, eps, norm_eps)


@hc_pre.register_fake
def _(X, fn, base, scale, norm_w, hc, iters, eps, norm_eps):
    return _site_outputs(X, hc)


@torch.library.custom_op(f"{_LIB}::hc_merge_pre", mutates_args=())
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ds4serve.kernels.hc_pre.hc_merge_pre`: a sublayer output's mHC merge and the next pre site in
    one launch, the merged streams ``[S, hc, D]`` then the outputs of :func:`hc_pre` on them. ``out`` is the
    output ``[S, D]`` or the fused MoE's fp32 slot terms ``[S, slots, D]``."""
    return _hc_merge_pre(X, out, post, comb, fn, base, scale, norm_w, hc, iters, eps, norm_eps)


@hc_merge_pre.register_fake
def _(X, out, post, comb, fn, base, scale, norm_w, hc, iters, eps, norm_eps):
    return X.new_empty(X.shape), *_site_outputs(X, hc)


def _site_outputs(X: torch.Tensor, hc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(post, comb, x_in)`` of a pre site on streams like ``X``: the fakes' outputs."""
    S, D = X.shape[0], X.shape[-1]
    post = X.new_empty(S, hc, dtype=torch.float32)
    return post, X.new_empty(S, hc, hc, dtype=torch.float32), X.new_empty(S, D)


@torch.library.custom_op(f"{_LIB}::moe_decode", mutates_args=())
def moe_decode(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor | None,
    w3: torch.Tensor,
    s3: torch.Tensor | None,
    w2: torch.Tensor,
    s2: torch.Tensor | None,
    routed_block: list[int],
    sw1: torch.Tensor,
    ss1: torch.Tensor | None,
    sw3: torch.Tensor,
    ss3: torch.Tensor | None,
    sw2: torch.Tensor,
    ss2: torch.Tensor | None,
    shared_block: list[int],
    limit: float,
    summed: bool = True,
) -> torch.Tensor:
    """Routed experts ``[E, out, in]`` (scales None when dense) plus the shared expert ``[out, in]``,
    for tokens ``x [N, D]`` routed to ``idx [N, k]`` with ``weights [N, k]``: three kernel launches,
    the shared expert one more slot in them; ``summed=False``: two, and the fp32 slot terms
    ``[N, k + 1, D]`` instead of their sum."""
    rb, sb = (routed_block[0], routed_block[1]), (shared_block[0], shared_block[1])
    routed = [moe.ExpertStack(w, s, rb) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    shared = tuple(moe.ExpertStack(w, s, sb) for w, s in ((sw1, ss1), (sw3, ss3), (sw2, ss2)))
    return moe.moe_fused(x, idx, weights, *routed, limit, shared=shared, summed=summed)


@moe_decode.register_fake
def _(
    x,
    idx,
    weights,
    w1,
    s1,
    w3,
    s3,
    w2,
    s2,
    routed_block,
    sw1,
    ss1,
    sw3,
    ss3,
    sw2,
    ss2,
    shared_block,
    limit,
    summed=True,
):
    if summed:
        return torch.empty_like(x)
    return x.new_empty(x.shape[0], idx.shape[1] + 1, x.shape[1], dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::route_decode", mutates_args=())
def route_decode(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    token_ids: torch.Tensor,
    k: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ds4serve.kernels.router.route_decode`: the MoE router of a few tokens in one launch,
    ``(weights [N, k] in x's dtype, expert ids [N, k] int64)`` (the arrival counter it uses is left zero)."""
    return router.route_decode(x, gate, bias, tid2eid, token_ids, k, scaling)


@route_decode.register_fake
def _(x, gate, bias, tid2eid, token_ids, k, scaling):
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.int64)


@torch.library.custom_op(f"{_LIB}::index_top", mutates_args=())
def index_top(
    q: torch.Tensor, keys: torch.Tensor, head_w: torch.Tensor, visible: torch.Tensor, k: int
) -> torch.Tensor:
    """:func:`ds4serve.kernels.indexer.index_top`: bool ``[S, T]``, the visible entries among the ``k``
    best by lightning-indexer score for ``q [S, ih, dim]`` (after RoPE) over ``keys [T, dim]``."""
    return indexer.index_top(q, keys, head_w, visible, k)


@index_top.register_fake
def _(q, keys, head_w, visible, k):
    return visible.new_empty(q.shape[0], keys.shape[0])


@torch.library.custom_op(f"{_LIB}::index_top_indices", mutates_args=())
def index_top_indices(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    open_row: torch.Tensor | None = None,
    open_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ds4serve.kernels.indexer.index_top_indices`: the same selection as :func:`index_top` as int32
    ``[S, k]`` entry indices, ascending, -1 for the unused places; the key at slot ``open_at [1]`` read from
    ``open_row [1, dim]`` when given."""
    return indexer.index_top_indices(q, keys, head_w, visible, k, _open(open_row, open_at))


@index_top_indices.register_fake
def _(q, keys, head_w, visible, k, open_row=None, open_at=None):
    return q.new_empty(q.shape[0], k, dtype=torch.int32)


@torch.library.custom_op(f"{_LIB}::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    allowed: list[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    open_row: torch.Tensor | None = None,
    open_at: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ds4serve.kernels.decode_attention.decode_attention`: ``[S, H, d]`` attention of ``q [S, H, d]``
    with a per-head sink over one or two key parts ``[K_i, d]`` (K = V) with bool masks ``[S or 1, K_i]``;
    the second part's row at slot ``open_at [1]`` read from ``open_row [1, d]`` when given."""
    return _decode_attention(q, keys, allowed, sinks, scale, open_entry=_open(open_row, open_at))


def _open(
    open_row: torch.Tensor | None, open_at: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    if (open_row is None) != (open_at is None):
        raise ValueError("open_row and open_at come together")
    return None if open_row is None else (open_row, open_at)


@decode_attention.register_fake
def _(q, keys, allowed, sinks, scale, open_row=None, open_at=None):
    return q.new_empty(q.shape)


@torch.library.custom_op(f"{_LIB}::attention_inputs", mutates_args=())
def attention_inputs(
    qr: torch.Tensor,
    kv: torch.Tensor,
    kv_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ring: torch.Tensor,
    pos: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ds4serve.kernels.attention_inputs.attention_inputs`: ``(q, kv, keys, allowed)`` of one decode
    token, its query and key row normalised and rotated, the window with its row in its slot and the mask."""
    return _attention_inputs(qr, kv, kv_norm, cos, sin, ring, pos, eps)


@attention_inputs.register_fake
def _(qr, kv, kv_norm, cos, sin, ring, pos, eps):
    return (
        qr.new_empty(qr.shape),
        kv.new_empty(kv.shape),
        ring.new_empty(ring.shape),
        ring.new_empty(1, ring.shape[0], dtype=torch.bool),
    )
