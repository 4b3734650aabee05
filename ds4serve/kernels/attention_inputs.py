"""A one-token decode step's attention inputs in one launch: the query and key norms, their RoPE and the window keys.

Between the query's projection and the decode attention the torch code of a layer
(:func:`ds4serve.model.attention.attention` with :func:`~ds4serve.model.attention._window_keys_static`) is the
per-head unweighted norm of ``q``, its RoPE, the weighted norm of the shared key/value row and its RoPE, and the
ring with that row in its slot plus the mask of the keys written so far. Inside a compiled decode block Inductor
makes about six small kernels of it (a reduction per norm, the RoPE concatenations, the ring's ``where``), ~1 us
each, at every one of the 43 layers. Here one launch does it all:

* programs ``0 .. ceil(H / BLOCK_H) - 1``: ``BLOCK_H`` heads of the query each, normalised and rotated;
* the rest: ``BLOCK_W`` rows of the window each, the ring's rows with the token's key row in its slot, and their
  mask; every one of them normalises and rotates the key row itself (one row of ``head_dim`` values: cheaper than
  waiting for another program), and the first also stores it (the row the step commits).

Rounding follows the torch code (run without FP contraction): ``q * rsqrt(mean(q^2) + eps)`` with the factor
rounded to the activation dtype, then the product rounded; ``w * (x * rsqrt(mean(x^2) + eps))`` in fp32 rounded
once; the RoPE in fp32 from the rounded values and the rounded cos/sin, rounded once (:func:`_rotated`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .hc_streams import EXACT_ROUNDING

BLOCK_H = 4  # query heads per program: 16 programs for the 64 heads of DeepSeek-V4-Flash
BLOCK_W = 16  # window rows per program: 8 programs for its 128-row ring


@triton.jit
def _rotated(v, partner, d, cos_row, sin_row, D: tl.constexpr, R: tl.constexpr):
    """``v`` (values at columns ``d``) with its last ``R`` columns rotated as interleaved pairs ``(2i, 2i + 1)``
    by the angles whose rounded cos/sin are ``cos_row[i]`` / ``sin_row[i]``: ``partner`` holds the values at
    columns ``d ^ 1``. The rotation runs in fp32 and is rounded to ``v``'s dtype, as
    :meth:`ds4serve.model.rope.Rope.apply` does."""
    r = d - (D - R)
    inr = (r >= 0) & (d < D)
    i = tl.maximum(r, 0) // 2
    c = tl.load(cos_row + i, mask=inr, other=1.0).to(tl.float32)
    s = tl.load(sin_row + i, mask=inr, other=0.0).to(tl.float32)
    vf = v.to(tl.float32)
    pf = partner.to(tl.float32)
    turned = tl.where(r % 2 == 0, vf * c - pf * s, vf * c + pf * s)
    return tl.where(inr, turned.to(v.dtype), v)


@triton.jit
def _key_row(kv_ptr, w_ptr, cos_row, sin_row, eps, D: tl.constexpr, D_P: tl.constexpr, R: tl.constexpr):
    """The token's key row: ``rms_norm(kv, w, eps)`` then its RoPE, ``[D_P]`` (0 past ``D``)."""
    d = tl.arange(0, D_P)
    dm = d < D
    x = tl.load(kv_ptr + d, mask=dm, other=0.0)
    xf = x.to(tl.float32)
    factor = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (tl.load(w_ptr + d, mask=dm, other=0.0) * (xf * factor)).to(x.dtype)
    partner = (
        tl.load(w_ptr + (d ^ 1), mask=dm, other=0.0)
        * (tl.load(kv_ptr + (d ^ 1), mask=dm, other=0.0).to(tl.float32) * factor)
    ).to(x.dtype)
    return _rotated(normed, partner, d, cos_row, sin_row, D, R)


@triton.jit
def _inputs_kernel(
    qr_ptr,
    kvr_ptr,
    kv_norm_ptr,
    cos_ptr,
    sin_ptr,
    ring_ptr,
    pos_ptr,
    q_ptr,
    kv_ptr,
    keys_ptr,
    allowed_ptr,
    H,
    W,
    eps,
    D: tl.constexpr,
    D_P: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.start(PDL)
    pid = tl.program_id(0)
    q_programs = tl.cdiv(H, BLOCK_H)
    d = tl.arange(0, D_P)
    dm = d < D
    if pid < q_programs:
        heads = pid * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = (heads < H)[:, None] & dm[None, :]
        rows = qr_ptr + heads[:, None] * D
        x = tl.load(rows + d[None, :], mask=hm, other=0.0)
        xf = x.to(tl.float32)
        factor = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps).to(x.dtype).to(tl.float32)[:, None]
        normed = (xf * factor).to(x.dtype)
        partner = (tl.load(rows + (d ^ 1)[None, :], mask=hm, other=0.0).to(tl.float32) * factor).to(x.dtype)
        q = _rotated(normed, partner, d[None, :], cos_ptr, sin_ptr, D, R)
        tl.store(q_ptr + heads[:, None] * D + d[None, :], q, mask=hm)
    else:
        block = pid - q_programs
        kv = _key_row(kvr_ptr, kv_norm_ptr, cos_ptr, sin_ptr, eps, D, D_P, R)
        if block == 0:
            tl.store(kv_ptr + d, kv, mask=dm)
        pos = tl.load(pos_ptr)
        slots = block * BLOCK_W + tl.arange(0, BLOCK_W)
        sm = slots < W
        wm = sm[:, None] & dm[None, :]
        ring = tl.load(ring_ptr + slots[:, None] * D + d[None, :], mask=wm, other=0.0)
        own = (slots == pos % W)[:, None]
        tl.store(keys_ptr + slots[:, None] * D + d[None, :], tl.where(own, kv[None, :], ring), mask=wm)
        written = pos - (pos - slots + W) % W >= 0  # the position slot s holds, as a floor modulo (pos >= 0)
        tl.store(allowed_ptr + slots, written, mask=sm)


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
    """``(q [1, H, d], kv [1, d], keys [W, d], allowed [1, W] bool)`` of one token at ``pos [1]``.

    ``qr [1, H, d]`` is the query's projection, ``kv [1, d]`` the key/value row's, ``kv_norm [d]`` its norm
    weight (fp32), ``cos`` / ``sin [1, rope_dim / 2]`` the token's rounded RoPE table rows and ``ring [W, d]``
    the committed window. ``q = rope(unweighted_rms_norm(qr))``, ``kv = rope(rms_norm(kv, kv_norm))``; ``keys``
    is the ring with ``kv`` in slot ``pos % W`` and ``allowed`` marks the slots holding a position ``>= 0``: the
    values of the torch code (module docstring)."""
    S, H, D = qr.shape
    W = ring.shape[0]
    if S != 1 or kv.shape != (1, D) or ring.shape[1] != D or cos.shape != sin.shape or cos.shape[0] != 1:
        raise ValueError(
            f"attention_inputs: one token; got q {tuple(qr.shape)}, kv {tuple(kv.shape)}, ring "
            f"{tuple(ring.shape)}, cos {tuple(cos.shape)}"
        )
    rope = 2 * cos.shape[1]
    q = torch.empty_like(qr)
    kv_out = torch.empty_like(kv)
    keys = torch.empty_like(ring)
    allowed = torch.empty(1, W, device=ring.device, dtype=torch.bool)
    grid = (triton.cdiv(H, BLOCK_H) + triton.cdiv(W, BLOCK_W),)
    _inputs_kernel[grid](
        qr.contiguous(),
        kv.contiguous(),
        kv_norm.float().contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        ring,
        pos,
        q,
        kv_out,
        keys,
        allowed,
        H,
        W,
        eps,
        D=D,
        D_P=triton.next_power_of_2(D),
        R=rope,
        BLOCK_H=BLOCK_H,
        BLOCK_W=BLOCK_W,
        num_warps=4,
        **EXACT_ROUNDING,
        **pdl.launch(qr),
    )
    return q, kv_out, keys, allowed
