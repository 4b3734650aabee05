"""Programmatic dependent launch (PDL) of the hand-written kernels (``config.current().pdl``, Hopper and later).

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running: every
such kernel first executes ``griddepcontrol.wait`` (:func:`start`), which returns once the previous grid
has completed and its writes are visible, so what each kernel computes is unchanged; right after its
wait it lets the next grid launch (``griddepcontrol.launch_dependents``). Inductor's kernels of the
compiled regions take part through its ``triton.enable_pdl`` option, so the chain is not broken
between a hand-written kernel and a fused one. On CPU tensors (Triton's interpreter) it is off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import config


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def enabled_for(t: torch.Tensor) -> bool:
    """Whether kernels on tensors like ``t`` are launched with PDL now."""
    return config.current().pdl and t.is_cuda and _supported(t.device)


def launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that calls :func:`start`: its ``PDL`` constant and,
    when on, Triton's ``launch_pdl`` launch option."""
    return {"PDL": True, "launch_pdl": True} if enabled_for(t) else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """Wait for the previous grid and its writes, then let the next grid launch (no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
