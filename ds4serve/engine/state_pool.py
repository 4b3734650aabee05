"""Sequence states kept for reuse from one request to the next."""

from __future__ import annotations

from typing import Callable

from ..state import SequenceState

MIN_STATE_TOKENS = 1024  # the smallest sequence state the engine allocates (see state_capacity)


class StatePool:
    """The sequence states of an engine: at most ``limit`` at a time, in use or free.

    A request takes the smallest free state that fits it (the most recently freed among equals, whose CUDA
    graphs are the ones captured), else a new one of :func:`state_capacity`, after dropping free ones to stay
    within the limit. A finished request's state comes back with :meth:`release`; a failed one's is dropped.
    ``on_drop`` hears of every state dropped (the engine frees the graphs captured over it).
    """

    def __init__(
        self,
        allocate: Callable[[int], SequenceState],
        max_context: int,
        limit: int,
        on_drop: Callable[[SequenceState], None],
    ):
        if limit < 1:
            raise ValueError(f"limit: expected >= 1, got {limit}")
        self._allocate = allocate
        self.max_context = max_context
        self.limit = limit
        self._on_drop = on_drop
        self._free: list[SequenceState] = []
        self._used: list[SequenceState] = []

    def acquire(self, need: int) -> SequenceState:
        """A state holding at least ``need`` tokens, reset or to be restored by the caller."""
        fits = [s for s in reversed(self._free) if s.max_context >= need]
        if fits:
            state = min(fits, key=lambda s: s.max_context)
            self._free.remove(state)
        else:
            while self._free and len(self._free) + len(self._used) >= self.limit:
                self._drop_free(min(self._free, key=lambda s: s.max_context))
            state = self._allocate(state_capacity(need, self.max_context))
        self._used.append(state)
        return state

    def release(self, state: SequenceState) -> None:
        """Give back a state whose request ended normally: the next request may reuse it."""
        self._used.remove(state)
        self._free.append(state)

    def drop(self, state: SequenceState) -> None:
        """Forget a state in use (its request failed: its contents are not to be trusted)."""
        self._used.remove(state)
        self._on_drop(state)

    def clear(self) -> None:
        """Forget every free state (the model is being parked, or a new state needs their memory)."""
        while self._free:
            self._drop_free(self._free[-1])

    @property
    def in_use(self) -> int:
        return len(self._used)

    def _drop_free(self, state: SequenceState) -> None:
        self._free.remove(state)
        self._on_drop(state)


def state_capacity(need: int, max_context: int, floor: int = MIN_STATE_TOKENS) -> int:
    """The tokens a new sequence state holds for a request that needs ``need``: the next power of two
    (at least ``floor``), capped at ``max_context``. States are reused while requests fit, and each new
    capacity means a new decode graph and, for the compiled regions, a new compile; powers of two
    bound both to a few per engine instead of one per larger request."""
    return min(max_context, max(floor, 1 << max(need - 1, 0).bit_length()))
