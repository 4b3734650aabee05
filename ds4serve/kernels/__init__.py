"""Triton kernels for the GPU hot spots, each beside the torch reference it must match.

The model code in :mod:`ds4serve.model` stays the reference; it calls :func:`enabled` to decide,
per call, whether a kernel applies (CUDA tensors, Triton importable, kernels not switched off).
On CPU the tests run the kernels themselves under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from typing import Iterator

import torch

# Checked without importing triton, so that tests can still choose the interpreter before it loads.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

_switched_off = False


def enabled(t: torch.Tensor) -> bool:
    """True when the model should dispatch to a Triton kernel for tensors like ``t``.

    False while torch.compile traces a region (:mod:`ds4serve.kernels.regions`): Inductor then
    sees the torch reference and fuses it with its neighbours.
    """
    return HAVE_TRITON and t.is_cuda and not _switched_off and not torch.compiler.is_compiling()


@contextmanager
def disabled() -> Iterator[None]:
    """Run the torch reference path everywhere inside this scope (baselines, A/B checks); compiled
    regions (:mod:`ds4serve.kernels.regions`) check :func:`enabled` too, so they are off as well."""
    global _switched_off
    previous, _switched_off = _switched_off, True
    try:
        yield
    finally:
        _switched_off = previous
