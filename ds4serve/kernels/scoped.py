"""A module-level setting changed for the duration of a ``with`` block (switches used by tests and A/B runs)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Scoped(Generic[T]):
    def __init__(self, default: T):
        self.value = default

    @contextmanager
    def set(self, value: T) -> Iterator[None]:
        """Hold ``value`` inside the block, then restore the previous value."""
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
