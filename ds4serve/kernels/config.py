"""The kernels' one frozen configuration: which implementation runs, decided once, read in one place.

:func:`current` is read by :func:`ds4serve.kernels.enabled`, :mod:`ds4serve.kernels.pdl` and
:mod:`ds4serve.kernels.regions`; :func:`configure` sets it (the engine, when it is built) and
:func:`using` changes it inside a ``with`` block (tests, benchmark baselines).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class KernelConfig:
    # Triton kernels and compiled regions on CUDA tensors; False: the torch reference everywhere.
    triton: bool = True
    # Programmatic dependent launch of the kernels on Hopper and later (kernels/pdl.py).
    pdl: bool = True
    # Tests: the kernels on CPU tensors too (Triton's interpreter, TRITON_INTERPRET=1).
    any_device: bool = False
    # The compiled regions' backend: "inductor" on the kernels' devices; None runs every region as written;
    # any other backend (tests: "aot_eager") compiles on every device with full graphs.
    regions: str | None = "inductor"


_current = KernelConfig()


def current() -> KernelConfig:
    """The configuration in force."""
    return _current


def configure(**fields: object) -> KernelConfig:
    """Replace some fields of the configuration (unknown names are an error); returns the new one."""
    global _current
    _current = dataclasses.replace(_current, **fields)
    return _current


@contextmanager
def using(**fields: object) -> Iterator[KernelConfig]:
    """:func:`configure` inside the block, then the configuration before it."""
    global _current
    previous = _current
    try:
        yield configure(**fields)
    finally:
        _current = previous
