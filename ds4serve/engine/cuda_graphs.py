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
from typing import Callable, TypeVar

import torch

from ..model import DeepSeekV4, ForwardResult
from ..state import ChunkDelta, SequenceState

T = TypeVar("T")


class Captured:
    """``run`` (which reads its inputs from tensors the caller fills) as a CUDA graph: ``warm`` (default
    ``run``) is called ``warmup`` times on a side stream, so that kernels compile and library handles
    exist before the capture, then ``setup`` once there, then ``run`` is captured. :meth:`replay`
    returns ``run``'s outputs: buffers that the next replay overwrites. With ``graph=False`` each
    replay calls ``run`` instead: the same code without a capture (CPU tests)."""

    def __init__(self, run: Callable[[], T], device: torch.device, *, graph: bool = True,
                 warm: Callable[[], object] | None = None, setup: Callable[[], object] | None = None,
                 warmup: int = 2):
        self._run = run
        self.graph: torch.cuda.CUDAGraph | None = None
        self.kept = None  # what ``setup`` returned: read by every replay, so kept with the graph
        if not graph:
            self.kept = setup() if setup is not None else None
            return
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                (warm or run)()
            self.kept = setup() if setup is not None else None
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = run()

    def replay(self) -> T:
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self._out


class DecodeGraph:
    """A captured one-token forward of ``model`` over ``state`` and its commit (logits included)."""

    def __init__(self, model: DeepSeekV4, state: SequenceState, warmup: int = 2):
        self.model = model
        self.state = state
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        self.pos = torch.full((1,), state.pos, dtype=torch.long, device=model.device)
        # warming up runs forwards only (it must not write the state); the commit's job table is
        # reserved before the capture and filled after it
        self._step = Captured(self._forward_and_commit, model.device, warm=self._forward,
                              setup=lambda: state.prepare_capture(self.pos), warmup=warmup)
        self.graph = self._step.graph
        state.finish_capture()

    def _forward(self) -> ForwardResult:
        return self.model.forward(self.token, self.state, logit_rows=slice(0, 1), positions=self.pos)

    def _forward_and_commit(self) -> ForwardResult:
        out = self._forward()
        self.state.write_token(out.delta, self.pos)
        return out

    def step(self, token: int) -> torch.Tensor:
        """Run ``token`` at ``state.pos`` and commit it; returns its logits ``[1, V]``, a buffer that
        the next step overwrites."""
        pos = self.state.pos
        if pos + 1 > self.state.max_context:
            raise ValueError(f"decode at position {pos} exceeds the state's {self.state.max_context}")
        self.token.fill_(token)
        self.pos.fill_(pos)
        out = self._step.replay()
        self.state.advance(token)
        return out.logits


class VerifyGraph:
    """A captured static forward of a ``width``-token block of ``model`` over ``state``: logits of
    every row, the final streams and the ``capture`` layers' streams (for the draft proposer).
    ``graph=False`` runs the same static forward without capturing it (CPU tests)."""

    def __init__(self, model: DeepSeekV4, state: SequenceState, width: int, capture: tuple[int, ...] = (),
                 warmup: int = 2, graph: bool = True):
        self.model, self.state, self.width, self.capture = model, state, width, capture
        self.tokens = torch.zeros(width, dtype=torch.long, device=model.device)
        self._offsets = torch.arange(width, device=model.device)
        self.positions = self._offsets + state.pos
        self._block = Captured(self._forward, model.device, graph=graph, warmup=warmup)
        self.graph = self._block.graph

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
        return self._block.replay()


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
