"""Programmatic dependent launch (PDL) of the hand-written kernels (``SWITCHES.pdl``, Hopper and later).

A decode step is ~2,000 kernels, most of them a few microseconds long, so the time between kernels
(the launch of the next grid, the ramp of its first loads) is a large part of the step. A kernel
launched with PDL may be scheduled while the kernel before it in the stream is still running: every
such kernel first executes ``griddepcontrol.wait`` (:func:`start`), which returns once the previous grid
has completed and its writes are visible, so what each kernel computes is unchanged; right after its
wait it lets the next grid launch (``griddepcontrol.launch_dependents``). Inductor's kernels of the
compiled regions take part through its ``triton.enable_pdl`` option, so the chain is not broken
between a hand-written kernel and a fused one.

Work that reads nothing the previous kernels write may run before the wait. Weights are never
written during a step, so with ``SWITCHES.weight_prefetch`` the GEMV first asks L2 for its program's
weight rows (:func:`prefetch_l2`), which overlaps the weight stream with the tail of the kernel before.
On CPU tensors (Triton's interpreter) both are off whatever the switches say.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .switches import SWITCHES

LINE_BYTES = 128  # what one L2 prefetch brings in


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled_for(t: torch.Tensor) -> bool:
    """Whether kernels on tensors like ``t`` are launched with PDL now."""
    return SWITCHES.pdl and t.is_cuda and _supported(t.device)


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that calls :func:`start`: its ``PDL`` constant and,
    when on, Triton's ``launch_pdl`` launch option."""
    return {"PDL": True, "launch_pdl": True} if enabled_for(t) else {"PDL": False}


def prefetching(t: torch.Tensor) -> bool:
    """Whether the GEMV prefetches its weights before waiting (``SWITCHES.weight_prefetch`` with PDL)."""
    return SWITCHES.weight_prefetch and enabled_for(t)


@triton.jit
def start(PDL: tl.constexpr):
    """Wait for the previous grid and its writes, then let the next grid launch (no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(row_ptrs, k_lo, k_hi, ELEMS_PER_LINE: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for elements ``[k_lo, k_hi)`` of each row at ``row_ptrs [R, 1]``, ``LINES`` lines of
    ``ELEMS_PER_LINE`` elements per row and loop step. The rows must be valid addresses (clamp masked
    rows); a line past ``k_hi`` is skipped."""
    for k0 in range(k_lo, k_hi, LINES * ELEMS_PER_LINE):
        cols = k0 + tl.arange(0, LINES)[None, :] * ELEMS_PER_LINE
        ptrs = row_ptrs + tl.minimum(cols, k_hi - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)
