"""Weights into L2 ahead of the kernels that read them (``SWITCHES.prefetch_weights``, Hopper).

Between the weight-streaming launches of a batch-1 decode step (GEMVs, the MoE) run dozens of small
kernels (norms, RoPE, the attention, the mHC sites) that move a few kilobytes each: for tens of
microseconds per layer DRAM is nearly idle. The weights the next GEMVs will read do not depend on
anything computed, so they can be fetched into L2 during that time; the GEMVs then read them at L2
speed. :func:`prefetch_l2` launches one small kernel that issues ``cp.async.bulk.prefetch.L2`` for
the first ``budget`` bytes of the given weights (the hardware fetches in the background; the kernel
does not wait for it) and copies ``x`` to its output: the copy gives the launch a data dependency, so
the compiled region keeps it where the model calls it, between the kernels that produce and consume
``x``.

The prefetches are issued before the kernel's ``griddepcontrol.wait`` (:func:`ds4serve.kernels.pdl.start`):
with programmatic dependent launch the kernel starts while the one before it still runs, and reading
weights needs nothing of it. Only the copy waits. A prefetch is a hint: it changes no value, so the
outputs are those of the same step without it. Off Hopper (and in Triton's CPU interpreter, which has
no inline PTX) only the copy runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

PROGRAMS = 132  # one per SM of the target GPU (H200)
LANES = 32  # one warp per program, one prefetch instruction per lane and tensor (no lane repeats another's)
MAX_TENSORS = 4
COPY_BLOCK = 256


@triton.jit
def _prefetch(base, nbytes, piece, p, LANES: tl.constexpr):
    """Program ``p``'s ``LANES`` pieces of ``piece`` bytes (a multiple of 16) of the first ``nbytes`` at
    ``base``; a lane past the end (or left with under 16 bytes) prefetches the first 16 bytes again."""
    offs = (p * LANES + tl.arange(0, LANES)).to(tl.int64) * piece
    size = tl.where(offs < nbytes, tl.minimum(nbytes - offs, piece) // 16 * 16, 0)
    addr = base + tl.where(size > 0, offs, 0)
    size = tl.where(size > 0, size, 16).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(x_ptr, y_ptr, n, a_ptr, a_bytes, a_piece, b_ptr, b_bytes, b_piece, c_ptr, c_bytes, c_piece,
                     d_ptr, d_bytes, d_piece, N_TENSORS: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
                     PREFETCH: tl.constexpr, PDL: tl.constexpr):
    p = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if PREFETCH:
        _prefetch(a_ptr, a_bytes, a_piece, p, LANES)
        if N_TENSORS > 1:
            _prefetch(b_ptr, b_bytes, b_piece, p, LANES)
        if N_TENSORS > 2:
            _prefetch(c_ptr, c_bytes, c_piece, p, LANES)
        if N_TENSORS > 3:
            _prefetch(d_ptr, d_bytes, d_piece, p, LANES)
    pdl.start(PDL)
    for start in range(p * BLOCK, n, n_prog * BLOCK):
        i = start + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


def budgeted(weights: list[torch.Tensor], budget: int) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, bytes to prefetch)`` for ``weights`` in order, until ``budget`` bytes are taken."""
    out = []
    for w in (w for w in weights if w.is_contiguous()):
        take = min(w.numel() * w.element_size(), budget)
        if take < 16:
            break
        out.append((w, take))
        budget -= take
    return out[:MAX_TENSORS]


def prefetch_l2(x: torch.Tensor, weights: list[torch.Tensor], budget: int) -> torch.Tensor:
    """A copy of ``x``; the launch that makes it also has L2 prefetch the first ``budget`` bytes of
    ``weights`` (contiguous tensors, in order; at most :data:`MAX_TENSORS` of them)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    parts = budgeted(weights, budget)
    prefetch = bool(parts) and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    args = []
    for i in range(MAX_TENSORS):
        w, nbytes = parts[i] if i < len(parts) else (x, 0)
        piece = max(triton.cdiv(triton.cdiv(nbytes, PROGRAMS * LANES), 16) * 16, 16)
        args += [w.view(-1).view(torch.uint8), nbytes, piece]
    _prefetch_kernel[(PROGRAMS if prefetch else 1,)](
        x.view(-1), y.view(-1), x.numel(), *args, N_TENSORS=max(len(parts), 1), LANES=LANES, BLOCK=COPY_BLOCK,
        PREFETCH=prefetch, num_warps=1, **pdl.launch(x))
    return y
