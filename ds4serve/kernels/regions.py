"""Compiled regions: the static decode step's small elementwise chains fused by Inductor.

A batch-1 decode step is bound by the weights it streams, but its torch code also issues a few
hundred tiny kernels per layer (norms, RoPE, mHC collapse/merge, compressor pooling, indexer
masking, the softmax with sinks), a few microseconds each even inside a CUDA graph. Functions of
:mod:`ds4serve.model` that hold such chains, and read no large weight, are marked with
:func:`region`. Inside a static step (:func:`static_step`, entered by the forward when it runs the
CUDA-graph path) on CUDA tensors, a region runs as ``torch.compile`` made it: Inductor fuses each
chain into one or a few Triton kernels, which the decode graph then captures like any other
kernel. Everywhere else (CPU, kernels switched off) the function runs as written, so the torch
code stays the one reference.

Prefill and verify chunks issue the same chains over thousands of rows, where each unfused op is a
full pass over memory (a RoPE's casts, stack and cat; a norm's fp32 copy, square, mean and product).
Regions marked ``chunks=True`` (the norms, RoPE, the mHC mixes, the routed experts' slot sum: plain
chains with no hand-written kernel inside) also run compiled in chunk forwards on CUDA when
``SWITCHES.chunk_regions`` is on, with dynamic shapes so that one compile serves every chunk length.

Regions nest: a region called while another is being traced is traced inline. While tracing,
:func:`ds4serve.kernels.enabled` is False, so a region never calls a hand-written Triton kernel
and Inductor sees plain torch ops. Casts between dtypes are kept where the code writes them
(``emulate_precision_casts``), so fused bf16 chains round where the eager code rounds.
"""

from __future__ import annotations

import functools
import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator, TypeVar

import torch

from .scoped import Scoped
from .switches import SWITCHES

F = TypeVar("F", bound=Callable)

_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}
_RECOMPILE_LIMIT = 64  # shapes differ per layer kind and per state size; each is compiled once

_local = threading.local()
_SWITCHED_OFF = Scoped(False)
_FORCED_BACKEND: Scoped[str | None] = Scoped(
    None
)  # tests: compile on any device with this backend, full graphs


def inductor_options() -> dict[str, object]:
    """Inductor's options for a region compiled now: the fixed ones and those the switches choose (a region
    compiles once per set, so that the arms of an A/B each run their own code)."""
    return {**_INDUCTOR_OPTIONS, "combo_kernels": SWITCHES.combo_kernels, "triton.enable_pdl": SWITCHES.pdl}


def _static_depth() -> int:
    return getattr(_local, "depth", 0)


@contextmanager
def static_step() -> Iterator[None]:
    """Scope of a static one-token step: regions called inside it may run compiled."""
    _local.depth = _static_depth() + 1
    try:
        yield
    finally:
        _local.depth -= 1


def disabled() -> AbstractContextManager:
    """Run every region as written (A/B timings)."""
    return _SWITCHED_OFF.set(True)


def forced(backend: str = "aot_eager") -> AbstractContextManager:
    """Tests: compile regions on any device with ``backend`` and ``fullgraph=True`` (a graph break
    is then an error), so CPU tests check that every region traces whole and matches eager."""
    return _FORCED_BACKEND.set(backend)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def _active(args: tuple, kwargs: dict, chunks: bool) -> str | None:
    """The backend to compile with for this call, or None to run the function as written."""
    if _SWITCHED_OFF.value or (_static_depth() == 0 and not (chunks and SWITCHES.chunk_regions)):
        return None
    t = _first_tensor(args, kwargs)
    if t is None:
        return None
    if _FORCED_BACKEND.value is not None:
        return _FORCED_BACKEND.value
    from . import enabled

    return "inductor" if enabled(t) else None


def region(fn: F | None = None, *, chunks: bool = False) -> F | Callable[[F], F]:
    """Mark ``fn`` as a compiled region (see the module doc); the plain function is ``fn.eager``.
    ``chunks=True``: also compiled in chunk forwards (``SWITCHES.chunk_regions``)."""
    if fn is None:
        return functools.partial(region, chunks=chunks)
    compiled: dict[tuple[str, bool, bool], Callable] = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        backend = _active(args, kwargs, chunks)
        if backend is None:
            return fn(*args, **kwargs)
        dynamic = _static_depth() == 0  # a chunk: any length, one compile
        options = inductor_options()
        key = (backend, dynamic, tuple(options.items()))
        if key not in compiled:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
            compiled[key] = torch.compile(
                fn,
                backend=backend,
                options=options if backend == "inductor" else None,
                dynamic=dynamic or None,
                fullgraph=_FORCED_BACKEND.value is not None,
            )
        return compiled[key](*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
