"""L2 prefetch of the weights a decode step reads next, issued by spare programs of latency-bound launches.

In a batch-1 decode step HBM idles while latency-bound launches run: an mHC site (~10 us), the attention
(~12 us at 512 context). The projection after such a window then starts cold, and a 33.5 MB FP8 GEMV
takes 11.6-14.1 us cold and 7.9-8.9 us when its weight was prefetched to L2 during the window (H200,
``bench/probe_l2.py`` of commit 0cb3e51; bench/RESULTS.md, thirteenth run). With ``SWITCHES.l2_prefetch`` a launch
in such a window gets :data:`PROGRAMS` extra programs: after the launch's PDL wait, each asks L2 for every
128-byte line of its pieces of a :func:`plan` (``prefetch.global.L2::evict_last``: the lines then outlast
the streaming loads of the kernels between) and ends. The instructions complete at once; the lines arrive
while the window's own programs run. Nothing reads them, so what every kernel computes is unchanged.

A plan is an int64 tensor ``[n, 2]`` of ``(address, bytes)`` pieces of at most :data:`PIECE_BYTES`,
covering the given weights in order up to :data:`BUDGET_BYTES` (less than the H200's 50 MB L2). The
addresses are the weights' storage: a plan is made once per layer and lives as long as its weights.
Triton's interpreter has no inline PTX, so launches on CPU tensors never get prefetch programs.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import triton
import triton.language as tl

PIECE_BYTES = 1 << 20
BUDGET_BYTES = 40 << 20
PROGRAMS = 16
_LINE = tl.constexpr(128)  # bytes of an L2 line request
_LANES = tl.constexpr(256)  # lines one loop step requests: one per thread of an 8-warp program


def plan(weights: Iterable[torch.Tensor], budget: int = BUDGET_BYTES, piece: int = PIECE_BYTES) -> torch.Tensor:
    """The ``(address, bytes)`` pieces ``[n, 2]`` (int64, on the weights' device) of ``weights``' storage,
    in order, until ``budget`` bytes; each piece at most ``piece`` bytes. Tensors must be contiguous."""
    rows: list[tuple[int, int]] = []
    device = None
    left = budget
    for t in weights:
        if not t.is_contiguous():
            raise ValueError("prefetch.plan: weights must be contiguous (a piece is one address range)")
        device = t.device
        n = min(t.numel() * t.element_size(), left)
        rows.extend((t.data_ptr() + off, min(piece, n - off)) for off in range(0, n, piece))
        left -= n
        if left <= 0:
            break
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


def launch(pieces: torch.Tensor | None, like: torch.Tensor) -> dict:
    """The prefetch arguments of a launch on tensors like ``like`` whose programs past its own
    (``pf_programs`` of them, which the caller adds to its grid) call :func:`issue`: none without a plan or
    on CPU tensors (then ``pf_ptr`` is a placeholder that nothing reads)."""
    if pieces is None or not like.is_cuda or pieces.shape[0] == 0:
        return {"pf_ptr": _placeholder(like.device), "pf_pieces": 0, "pf_programs": 0}
    return {"pf_ptr": pieces, "pf_pieces": pieces.shape[0], "pf_programs": PROGRAMS}


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, 2, dtype=torch.int64, device=device)


@triton.jit
def issue(pieces_ptr, n_pieces, prog, n_programs):
    """Program ``prog`` of ``n_programs`` requests the L2 lines of its pieces (``prog``, ``prog + n``, ...)."""
    lanes = tl.arange(0, _LANES) * _LINE
    for i in range(prog, n_pieces, n_programs):
        addr = tl.load(pieces_ptr + 2 * i)
        n = tl.load(pieces_ptr + 2 * i + 1)
        for off in range(0, n, _LANES * _LINE):
            lines = (addr + tl.minimum(off + lanes, n - 1)).to(tl.pointer_type(tl.int8))
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [lines],
                                      dtype=tl.int32, is_pure=False, pack=1)
