"""The decode step captured once as a CUDA graph and replayed at every position.

:meth:`DeepSeekV4.forward` with ``positions=`` runs a *static* one-token step: the token and its
position are read from two device tensors, every shape is independent of the position, and nothing
synchronises with the host. :class:`DecodeGraph` captures that step over one
:class:`~ds4serve.state.SequenceState` (its tensors are read in place, so the graph belongs to that
state object), then each :meth:`DecodeGraph.step` writes the token and position into the input
tensors and replays. Plain decoding always commits the one token it ran, so the graph also holds
that commit (:meth:`~ds4serve.state.SequenceState.write_token`, device writes at the device
position): a step is one replay plus the host counters.

A speculative verify step commits only the accepted prefix of its block, which the host knows after
the replay. :class:`VerifyGraph` captures the static forward of a block of one width (no commit); the
caller then commits the prefix with :meth:`~ds4serve.state.SequenceState.commit_static`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model import DeepSeekV4, ForwardResult
from ..state import ChunkDelta, SequenceState


class DecodeGraph:
    """A captured one-token forward of ``model`` over ``state`` and its commit (logits included)."""

    def __init__(self, model: DeepSeekV4, state: SequenceState, warmup: int = 2):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, got device {model.device}")
        self.model = model
        self.state = state
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        self.pos = torch.full((1,), state.pos, dtype=torch.long, device=model.device)
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # compile kernels and create library handles outside the capture
            for _ in range(warmup):  # forwards only: warming up must not write the state
                self._forward()
            self._commit_table = state.prepare_capture(self.pos)  # read by every replay: kept with the graph
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = self._forward()
            state.write_token(self._out.delta, self.pos)
        state.finish_capture()

    def _forward(self) -> ForwardResult:
        return self.model.forward(self.token, self.state, logit_rows=slice(0, 1), positions=self.pos)

    def step(self, token: int) -> torch.Tensor:
        """Run ``token`` at ``state.pos`` and commit it; returns its logits ``[1, V]``, a buffer that
        the next step overwrites."""
        pos = self.state.pos
        if pos + 1 > self.state.max_context:
            raise ValueError(f"decode at position {pos} exceeds the state's {self.state.max_context}")
        self.token.fill_(token)
        self.pos.fill_(pos)
        self.graph.replay()
        self.state.advance(token)
        return self._out.logits


class VerifyGraph:
    """A captured static forward of a ``width``-token block of ``model`` over ``state``: logits of
    every row, the final streams and the ``capture`` layers' streams (for the draft proposer)."""

    def __init__(self, model: DeepSeekV4, state: SequenceState, width: int, capture: tuple[int, ...] = (),
                 warmup: int = 2):
        if model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, got device {model.device}")
        self.model, self.state, self.width, self.capture = model, state, width, capture
        self.tokens = torch.zeros(width, dtype=torch.long, device=model.device)
        self._offsets = torch.arange(width, device=model.device)
        self.positions = self._offsets + state.pos
        side = torch.cuda.Stream(model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):  # compile kernels and create library handles outside the capture
            for _ in range(warmup):
                self._forward()
        torch.cuda.current_stream(model.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = self._forward()

    def _forward(self) -> ForwardResult:
        return self.model.forward(self.tokens, self.state, logit_rows=slice(None), capture=self.capture,
                                  positions=self.positions)

    def run(self, block: list[int]) -> ForwardResult:
        """The forward of ``block`` at ``state.pos``: buffers that the next run overwrites."""
        pos = self.state.pos
        if len(block) != self.width:
            raise ValueError(f"a verify graph of width {self.width} got a block of {len(block)}")
        if pos + self.width > self.state.max_context:
            raise ValueError(f"verify at position {pos} exceeds the state's {self.state.max_context}")
        self.tokens.copy_(torch.tensor(block, dtype=torch.long))
        torch.add(self._offsets, pos, out=self.positions)
        self.graph.replay()
        return self._out


def delta_at(template: ChunkDelta, pos: int, token: int) -> ChunkDelta:
    """The captured delta's tensors with the host-side counters of this step."""
    layers = {}
    for i, ld in template.layers.items():
        fixed = {}
        for name in ("compressor", "indexer"):
            cd = getattr(ld, name)
            if cd is not None:
                fixed[name] = dataclasses.replace(cd, first_entry=pos // cd.rows_kv.shape[0])
        layers[i] = dataclasses.replace(ld, **fixed)
    return ChunkDelta(start=pos, tokens=[token], layers=layers)
