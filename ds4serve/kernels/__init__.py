"""Triton kernels for the GPU hot spots, each beside the torch reference it must match.

The model code in :mod:`ds4serve.model` stays the reference; it calls :func:`enabled` to decide whether
a kernel applies to tensors like ``t`` (CUDA tensors, Triton importable, ``config.current().triton``).
On CPU the tests run the kernels themselves under ``TRITON_INTERPRET=1`` (:func:`on_any_device`).
"""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager

import torch

from . import config

# Checked without importing triton, so that tests can still choose the interpreter before it loads.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def enabled(t: torch.Tensor) -> bool:
    """True when the model should dispatch to a Triton kernel for tensors like ``t``. Inside a compiled
    region the kernels are traced as custom ops (:mod:`ds4serve.kernels.ops`)."""
    cfg = config.current()
    return HAVE_TRITON and cfg.triton and (t.is_cuda or cfg.any_device)


def disabled() -> AbstractContextManager:
    """The torch reference everywhere inside this scope, compiled regions included."""
    return config.using(triton=False)


def on_any_device() -> AbstractContextManager:
    """Tests: dispatch to the kernels for CPU tensors as well (run with ``TRITON_INTERPRET=1``)."""
    return config.using(any_device=True)
