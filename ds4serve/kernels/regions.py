"""Compiled regions: small elementwise chains of the model fused by Inductor.

Functions of :mod:`ds4serve.model` that hold chains of small ops and read no large weight (norms, RoPE,
mHC collapse/merge, compressor pooling, indexer masking, the softmax with sinks) are marked with
:func:`region`. Inside a static step (:func:`static_step`, the CUDA-graph path) on the kernels' devices a
region runs as ``torch.compile`` made it, and the decode graph captures the fused kernels. Regions marked
``chunks=True`` (plain chains with no hand-written kernel inside) also run compiled in chunk forwards, with
dynamic shapes so that one compile serves every chunk length. Everywhere else, and with
``config.current().regions`` None, the function runs as written: the torch code stays the one reference.

Regions nest: a region called while another is being traced is traced inline. Casts between dtypes are
kept where the code writes them (``emulate_precision_casts``), so fused bf16 chains round where the eager
code rounds.
"""

from __future__ import annotations

import functools
import threading
from contextlib import AbstractContextManager, contextmanager
from typing import Callable, Iterator, TypeVar

import torch

from . import config

F = TypeVar("F", bound=Callable)

_INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "combo_kernels": True}
_RECOMPILE_LIMIT = 64  # shapes differ per layer kind and per state size; each is compiled once

_local = threading.local()


def inductor_options() -> dict[str, object]:
    """Inductor's options for a region compiled now (a region compiles once per set)."""
    return {**_INDUCTOR_OPTIONS, "triton.enable_pdl": config.current().pdl}


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
    """Run every region as written inside this scope."""
    return config.using(regions=None)


def forced(backend: str = "aot_eager") -> AbstractContextManager:
    """Tests: compile regions on any device with ``backend`` and ``fullgraph=True`` (a graph break
    is then an error), so CPU tests check that every region traces whole and matches eager."""
    return config.using(regions=backend)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def _active(args: tuple, kwargs: dict, chunks: bool) -> str | None:
    """The backend to compile with for this call, or None to run the function as written."""
    backend = config.current().regions
    if backend is None or (_static_depth() == 0 and not chunks):
        return None
    t = _first_tensor(args, kwargs)
    if t is None:
        return None
    if backend != "inductor":
        return backend
    from . import enabled

    return backend if enabled(t) else None


def region(fn: F | None = None, *, chunks: bool = False) -> F | Callable[[F], F]:
    """Mark ``fn`` as a compiled region (see the module doc); the plain function is ``fn.eager``.
    ``chunks=True``: also compiled in chunk forwards."""
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
                fullgraph=backend != "inductor",
            )
        return compiled[key](*args, **kwargs)

    call.eager = fn  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
