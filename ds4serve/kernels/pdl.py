"""Programmatic dependent launch (PDL) of the hand-written kernels (``SWITCHES.pdl``, Hopper and later).

A decode step is ~2,000 kernels, most of them a few microseconds long, so the time between kernels
(the launch of the next grid, the ramp of its first loads) is a large part of the step. A kernel
launched with PDL may be scheduled while the kernel before it in the stream is still running: every
such kernel first executes ``griddepcontrol.wait`` (:func:`start`), which returns once the previous grid
has completed and its writes are visible, so what each kernel computes is unchanged; right after its
wait it lets the next grid launch (``griddepcontrol.launch_dependents``). Inductor's kernels of the
compiled regions take part through its ``triton.enable_pdl`` option, so the chain is not broken
between a hand-written kernel and a fused one.

A weight-streaming kernel launched this way can also start reading its weights before its wait: they
do not depend on the kernel before it. :func:`prefetch_l2` asks L2 for the first lines each program will
read (``SWITCHES.prefetch_weights``), so that the memory latency of a kernel's first loads overlaps the
kernel before it instead of following it. How many bytes to ask for: :func:`prefetch_lines`.

On CPU tensors (Triton's interpreter) it is off whatever the switch says.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .switches import SWITCHES


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled_for(t: torch.Tensor) -> bool:
    """Whether kernels on tensors like ``t`` are launched with PDL now."""
    return SWITCHES.pdl and t.is_cuda and _supported(t.device)


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that calls :func:`start`: its ``PDL`` constant and,
    when on, Triton's ``launch_pdl`` launch option."""
    if not enabled_for(t):
        return {"PDL": 0}
    return {"PDL": EARLY if SWITCHES.early_release else WAIT_FIRST, "launch_pdl": True}


WAIT_FIRST, EARLY = 1, 2  # values of a kernel's PDL constant when on: the order of its wait and release


PREFETCH_BYTES_PER_SM = 32 << 10  # about what one SM streams during one memory latency at full bandwidth
LINE = 128  # bytes of one L2 line request
LINE_BYTES = tl.constexpr(LINE)


def prefetch_lines(t: torch.Tensor, programs: int, rows_per_program: int, row_bytes: int, sms: int) -> int:
    """Lines per weight row that each of ``programs`` programs (``rows_per_program`` rows of ``row_bytes``
    each) prefetches before its wait: a power of two giving about :data:`PREFETCH_BYTES_PER_SM` per SM
    in all, at most the row; 0 when prefetching is off for ``t``'s kernels."""
    if not (SWITCHES.prefetch_weights and enabled_for(t)):
        return 0
    want = PREFETCH_BYTES_PER_SM * sms // max(programs * rows_per_program * LINE, 1)
    have = triton.cdiv(row_bytes, LINE)
    lines = 1
    while lines * 2 <= min(want, have):
        lines *= 2
    return lines


@triton.jit
def prefetch_l2(starts, n_elems, LINES: tl.constexpr):
    """Ask L2 for the first ``LINES`` lines of the ``n_elems`` elements from each pointer of ``starts`` (a 1-D
    tensor of valid pointers) without waiting for them; lines past the elements ask for the last one."""
    if LINES > 0:
        n_bytes = n_elems.to(tl.int64) * (starts.dtype.element_ty.primitive_bitwidth // 8)
        offsets = tl.minimum(tl.arange(0, LINES).to(tl.int64) * LINE_BYTES, n_bytes - 1)
        lines = starts.to(tl.int64, bitcast=True)[:, None] + offsets[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def start(PDL: tl.constexpr):
    """Wait for the previous grid and its writes, then let the next grid launch (no-op without PDL); with
    ``PDL == EARLY`` the release comes first, so that the next grid may be scheduled (and prefetch its
    weights) as soon as every program of this one has started. Either way each kernel waits for the one
    before it, which waited for its own predecessor, so every kernel still sees all earlier writes."""
    if PDL == 2:  # EARLY
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

