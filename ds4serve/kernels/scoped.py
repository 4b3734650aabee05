"""A module-level setting changed for the duration of a ``with`` block (switches used by tests and A/B runs)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Generic, Iterator, MutableMapping, TypeVar

K = TypeVar("K")
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


@contextmanager
def overridden(mapping: MutableMapping[K, T], entries: dict[K, T]) -> Iterator[None]:
    """``mapping`` with ``entries`` replacing (or adding) some of its items inside the block, then as before
    (tile tables timed by benchmarks)."""
    missing = object()
    saved = {key: mapping.get(key, missing) for key in entries}
    mapping.update(entries)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is missing:
                mapping.pop(key)
            else:
                mapping[key] = value
