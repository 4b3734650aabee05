"""Phase profiler hooks.

The model and engine call :func:`phase` around the phases of a forward and :func:`step` around
whole steps. While profiling is off (the default) both return one shared no-op context manager:
no events, no synchronisation, no output.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

_NOOP = nullcontext()
_active = None  # the enabled profiler, or None


def phase(name: str) -> AbstractContextManager:
    """Scope of one phase inside a forward (``hc_pre``, ``attention``, ``compressor``, ...)."""
    return _NOOP if _active is None else _active.phase(name)


def step(mode: str, tokens: int, kv_start: int, layers: range) -> AbstractContextManager:
    """Scope of a whole step: a prefill chunk, a decode step, a verify step or a draft forward."""
    return _NOOP if _active is None else _active.step(mode, tokens, kv_start, layers)
