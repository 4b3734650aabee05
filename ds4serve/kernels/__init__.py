"""Triton kernels for the GPU hot spots, each beside the torch reference it must match.

The model code in :mod:`ds4serve.model` stays the reference; it calls :func:`enabled` to decide,
per call, whether a kernel applies (CUDA tensors, Triton importable, kernels not switched off).
On CPU the tests run the kernels themselves under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager

import torch

from .scoped import Scoped

# Checked without importing triton, so that tests can still choose the interpreter before it loads.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

_SWITCHED_OFF = Scoped(False)
_ON_ANY_DEVICE = Scoped(False)  # tests: kernels on CPU tensors too (Triton's interpreter)


def enabled(t: torch.Tensor) -> bool:
    """True when the model should dispatch to a Triton kernel for tensors like ``t``.

    While torch.compile traces a region (:mod:`ds4serve.kernels.regions`), False unless the
    kernels are traced as custom ops (:mod:`ds4serve.kernels.ops`, ``SWITCHES.block_regions``):
    Inductor then sees the torch reference of the small regions and fuses it with its neighbours.
    """
    if not (HAVE_TRITON and (t.is_cuda or _ON_ANY_DEVICE.value) and not _SWITCHED_OFF.value):
        return False
    from .switches import SWITCHES

    return SWITCHES.block_regions or not torch.compiler.is_compiling()


def disabled() -> AbstractContextManager:
    """Run the torch reference path everywhere inside this scope (baselines, A/B checks); compiled
    regions (:mod:`ds4serve.kernels.regions`) check :func:`enabled` too, so they are off as well."""
    return _SWITCHED_OFF.set(True)


def on_any_device() -> AbstractContextManager:
    """Tests: dispatch to the kernels for CPU tensors as well (run with ``TRITON_INTERPRET=1``)."""
    return _ON_ANY_DEVICE.set(True)
