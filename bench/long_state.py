"""A sequence state at a long position without prefilling it, for decode timings and tests past 2^17.

A real prefill of a million tokens takes minutes; a decode step's cost depends on how much state it reads
(window, every compressed entry, the indexer's keys), not on the values. :func:`synthetic_state` commits
random rows in their places instead: the window ring, each compressor's entries and open-window rows, the CSA
overlap halves, with the state's counters at ``pos`` as if that many tokens had been committed.
"""

from __future__ import annotations

import torch

from ds4serve.model import DeepSeekV4
from ds4serve.state import SequenceState


def synthetic_state(model: DeepSeekV4, pos: int, capacity: int, seed: int) -> SequenceState:
    """A state of ``capacity`` tokens at ``pos`` whose committed rows are random (unit scale, in the model's
    dtype, drawn on the model's device from ``seed``)."""
    if not 0 <= pos <= capacity:
        raise ValueError(f"pos: expected 0 <= pos <= capacity ({capacity}), got {pos}")
    g = torch.Generator(device=model.device).manual_seed(seed)
    state = model.new_state(capacity)

    def fill(t: torch.Tensor) -> None:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device).to(t.dtype))

    for ls in state.layers.values():
        fill(ls.window)
        for c in ls.compressors():
            n_entries, n_buf = divmod(pos, c.rate)
            fill(c.entries[:n_entries])
            fill(c.buf_kv[:n_buf])
            fill(c.buf_gate[:n_buf])
            if c.overlap:
                fill(c.ov_kv)
                fill(c.ov_gate)
    state.pos = pos
    state.tokens = [0] * pos
    return state
