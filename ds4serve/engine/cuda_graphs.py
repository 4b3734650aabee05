"""The decode step captured once as a CUDA graph and replayed at every position.

:meth:`DeepSeekV4.forward` with ``positions=`` runs a *static* one-token step: the token and its
position are read from two device tensors, every shape is independent of the position, and nothing
synchronises with the host. :class:`DecodeGraph` captures that step over one
:class:`~ds4serve.state.SequenceState` (its tensors are read in place, so the graph belongs to that
state object), then each :meth:`DecodeGraph.step` writes the token and position into the input
tensors and replays. Plain decoding always commits the one token it ran, so the graph also holds
that commit (:class:`~ds4serve.engine.device_commit.DeviceCommit`, device writes at the device
position): a step is one replay plus the host counters.

Each captured step also takes its logits' argmax (``choices``), read back where that decides the token.

A speculative verify step commits only the accepted prefix of its block, which the host knows after
the replay. :class:`VerifyGraph` captures the static forward of a block of one width (no commit), and
its :meth:`VerifyGraph.commit` the device writes of each accepted count as a graph of its own.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import TYPE_CHECKING, Callable, TypeVar

import torch

from ..devices import ids_on, on_device
from ..model import DeepSeekV4, ForwardResult
from ..model.batch import BatchForward
from ..state import ChunkDelta, SequenceState
from .device_commit import DeviceCommit
from .sampler import graph_argmax

if TYPE_CHECKING:
    from ..parallel import SplitModel

T = TypeVar("T")


class Captured:
    """``run`` (which reads its inputs from tensors the caller fills) as a CUDA graph: ``warm`` (default
    ``run``) is called ``warmup`` times on a side stream, so that kernels compile and library handles
    exist before the capture, then ``setup`` once there, then ``run`` is captured. :meth:`replay`
    returns ``run``'s outputs: buffers that the next replay overwrites. ``pool``: a memory pool
    (``torch.cuda.graph_pool_handle()``) shared with graphs that never run at the same time as this one.
    With ``graph=False`` each replay calls ``run`` instead: the same code without a capture (CPU tests)."""

    def __init__(
        self,
        run: Callable[[], T],
        device: torch.device,
        *,
        graph: bool = True,
        warm: Callable[[], object] | None = None,
        setup: Callable[[], object] | None = None,
        warmup: int = 2,
        pool: object | None = None,
    ):
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
        # captured on the side stream: torch.cuda.graph's default capture stream is one stream for the
        # whole process, made on whichever device captured first, so a second GPU's capture would run
        # on the first GPU's stream. Graphs are captured lazily while a server runs; "thread_local" keeps
        # another thread's CUDA calls (an HTTP handler, a metrics read) from invalidating the capture, and
        # the garbage collector is off meanwhile: collecting a dead graph resets it, which a capture forbids.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, stream=side, pool=pool, capture_error_mode="thread_local"):
                self._out = run()
        finally:
            if collecting:
                gc.enable()

    def replay(self) -> T:
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self._out


Forward = TypeVar("Forward", ForwardResult, BatchForward)


def with_choices(out: Forward) -> Forward:
    """``out`` with its logits' argmax as ``choices`` (:func:`~ds4serve.engine.sampler.graph_argmax`, for code a
    graph captures), where it has logits (a shard without the head has none)."""
    if out.logits is not None:
        out.choices = graph_argmax(out.logits)
    return out


class DecodeGraph:
    """A captured one-token forward of ``model`` over ``state`` and its commit (logits included).

    ``model`` may be one shard of a layer split: then ``hidden`` is the device buffer its incoming
    streams are copied into before each replay (:class:`SplitDecodeGraph`), and a shard without the
    head returns no logits. ``graph=False`` runs the same step uncaptured (CPU tests)."""

    def __init__(
        self,
        model: DeepSeekV4,
        state: SequenceState,
        warmup: int = 2,
        hidden: torch.Tensor | None = None,
        graph: bool = True,
    ):
        self.model = model
        self.state = state
        self.hidden = hidden
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        self.pos = torch.full((1,), state.pos, dtype=torch.long, device=model.device)
        self._writes = DeviceCommit(state)
        # warming up runs forwards only (it must not write the state); the commit's job table is
        # reserved before the capture and filled after it
        self._step = Captured(
            self._forward_and_commit,
            model.device,
            graph=graph,
            warm=self._forward,
            setup=lambda: self._writes.prepare_capture(self.pos),
            warmup=warmup,
        )
        self.graph = self._step.graph
        self._writes.finish_capture()

    def _forward(self) -> ForwardResult:
        rows = slice(0, 1) if self.model.head is not None else None
        out = self.model.forward(
            self.token, self.state, hidden=self.hidden, logit_rows=rows, positions=self.pos
        )
        return with_choices(out)

    def _forward_and_commit(self) -> ForwardResult:
        out = self._forward()
        self._writes.write_token(out.delta, self.pos)
        return out

    def replay(self, token: int, pos: int) -> ForwardResult:
        """The device half of a step: forward ``token`` at ``pos`` and write its rows; buffers that the
        next replay overwrites."""
        self.token.fill_(token)
        self.pos.fill_(pos)
        return self._step.replay()

    def step(self, token: int) -> ForwardResult:
        """Run ``token`` at ``state.pos`` and commit it; returns its logits ``[1, V]`` and their argmax
        (``choices``), buffers that the next step overwrites."""
        _check_room(self.state, 1, "decode")
        out = self.replay(token, self.state.pos)
        self.state.advance(token)
        return out


class SplitDecodeGraph:
    """The decode step of a :class:`~ds4serve.parallel.SplitModel` on CUDA devices: one
    :class:`DecodeGraph` per shard, over the shard's part of ``state``
    (:meth:`~ds4serve.state.SequenceState.part`), replayed in layer order. The streams leaving a shard
    are copied into the next shard's input buffer between the replays: a copy across devices, which
    a graph of one device does not hold. Same interface as :class:`DecodeGraph`."""

    def __init__(self, model: "SplitModel", state: SequenceState, warmup: int = 2, graph: bool = True):
        self.model, self.state = model, state
        self.parts = _per_shard(
            model,
            state,
            1,
            lambda shard, part, hidden: DecodeGraph(shard, part, warmup, hidden=hidden, graph=graph),
        )

    def step(self, token: int) -> ForwardResult:
        """:meth:`DecodeGraph.step` over every shard in turn: the last shard's result."""
        _check_room(self.state, 1, "decode")
        pos = self.state.pos
        out = _through_shards(self.parts, lambda part: part.replay(token, pos))[-1]
        self.state.advance(token)
        return out


class VerifyGraph:
    """A captured static forward of a ``width``-token block of ``model`` over ``state``: logits of
    every row and their argmax (``choices``), the final streams and the ``capture`` layers' streams
    (for the draft proposer); and the device writes that commit an accepted prefix of it.
    ``hidden``: as for :class:`DecodeGraph`, when ``model`` is one shard of a split. ``pool``: a memory pool
    shared with other verify graphs (:class:`Captured`): then a replay's outputs are valid until the next
    replay of any of them. ``graph=False`` runs the same static forward without capturing it (CPU tests)."""

    def __init__(
        self,
        model: DeepSeekV4,
        state: SequenceState,
        width: int,
        capture: tuple[int, ...] = (),
        warmup: int = 2,
        graph: bool = True,
        hidden: torch.Tensor | None = None,
        pool: object | None = None,
    ):
        self.model, self.state, self.width, self.capture, self.hidden = model, state, width, capture, hidden
        self.tokens = torch.zeros(width, dtype=torch.long, device=model.device)
        self._offsets = torch.arange(width, device=model.device)
        self.positions = self._offsets + state.pos
        self._block = Captured(self._forward, model.device, graph=graph, warmup=warmup, pool=pool)
        self.graph = self._block.graph
        self._last: ForwardResult | None = None
        self._writes = DeviceCommit(state)
        self._writers: dict[int, Captured] = {}  # accepted count -> the captured commit of that many

    def _forward(self) -> ForwardResult:
        rows = slice(None) if self.model.head is not None else None
        out = self.model.forward(
            self.tokens,
            self.state,
            hidden=self.hidden,
            logit_rows=rows,
            capture=self.capture,
            positions=self.positions,
        )
        return with_choices(out)

    def run(self, block: list[int] | torch.Tensor) -> ForwardResult:
        """The forward of ``block`` (host ids, or a device tensor of them) at ``state.pos``: buffers that the
        next run overwrites."""
        _check_block(self.state, self.width, block)
        return self.replay(block, self.state.pos)

    def replay(self, block: list[int] | torch.Tensor, pos: int) -> ForwardResult:
        """The forward of ``block`` at ``pos``, unchecked (the caller checked it). ``block`` may be :attr:`tokens`
        itself, written by a draft proposer (:meth:`~ds4serve.engine.engine.Engine.verify_block`)."""
        if block is not self.tokens:
            self.tokens.copy_(block if isinstance(block, torch.Tensor) else ids_on(block, self.tokens.device))
        torch.add(self._offsets, pos, out=self.positions)
        self._last = self._block.replay()
        return self._last

    def commit(self, tokens: list[int]) -> None:
        """Commit the last block's first ``len(tokens)`` tokens: device writes at its device positions,
        captured once per accepted count (the state :meth:`~ds4serve.state.SequenceState.commit_static`
        would leave), then the host counters."""
        self.write(len(tokens))
        self.state.advance_block(tokens)

    def write(self, n: int) -> None:
        """The device half of :meth:`commit`."""
        delta = self._last.delta
        writes = self._writes
        if self.graph is None:  # uncaptured (CPU tests): every run returns new buffers
            writes.write_block(delta, self.positions, n, writes.block_plans(delta, n, self.positions))
            return
        writer = self._writers.get(n)
        if writer is None:  # the graph's buffers: the same at every replay, so the tables are built once
            plans = writes.block_plans(delta, n, self.positions)
            writer = self._writers[n] = Captured(
                lambda: writes.write_block(delta, self.positions, n, plans), self.model.device, warmup=0
            )
        writer.replay()


class SplitVerifyGraph:
    """:class:`VerifyGraph` of a :class:`~ds4serve.parallel.SplitModel`: one per shard, replayed in layer
    order like :class:`SplitDecodeGraph`; the result merges the shards' deltas and captured streams."""

    def __init__(
        self,
        model: "SplitModel",
        state: SequenceState,
        width: int,
        capture: tuple[int, ...] = (),
        warmup: int = 2,
        graph: bool = True,
    ):
        self.model, self.state, self.width, self.capture = model, state, width, capture
        self.parts = _per_shard(
            model,
            state,
            width,
            lambda shard, part, hidden: VerifyGraph(
                shard, part, width, capture, warmup, graph, hidden=hidden
            ),
        )

    def run(self, block: list[int] | torch.Tensor) -> ForwardResult:
        """:meth:`VerifyGraph.run` over every shard in turn."""
        _check_block(self.state, self.width, block)
        pos = self.state.pos
        outs = _through_shards(self.parts, lambda part: part.replay(block, pos))
        layers, captured = {}, {}
        for out in outs:
            layers.update(out.delta.layers)
            captured.update(out.captured)
        return ForwardResult(
            hidden=outs[-1].hidden,
            delta=ChunkDelta(start=pos, tokens=[], layers=layers),
            logits=outs[-1].logits,
            captured=captured,
            choices=outs[-1].choices,
        )

    def commit(self, tokens: list[int]) -> None:
        """:meth:`VerifyGraph.commit` on every shard's part, then the host counters."""
        for part in self.parts:
            with on_device(part.model.device):
                part.write(len(tokens))
        self.state.advance_block(tokens)


def _per_shard(
    model: "SplitModel",
    state: SequenceState,
    rows: int,
    make: Callable[[DeepSeekV4, SequenceState, torch.Tensor | None], T],
) -> list[T]:
    """``make(shard, its part of state, its input streams buffer)`` for every shard, each built with
    its own device current; the first shard embeds the tokens (no input buffer)."""
    parts = []
    cfg = model.cfg
    for k, shard in enumerate(model.shards):
        hidden = (
            None
            if k == 0
            else torch.zeros(rows, cfg.hc_mult, cfg.hidden_size, dtype=shard.dtype, device=shard.device)
        )
        with on_device(shard.device):
            parts.append(make(shard, state.part(shard.layers), hidden))
    return parts


def _through_shards(parts: list, replay: Callable[[object], ForwardResult]) -> list[ForwardResult]:
    """``replay(part)`` for every shard's part in layer order, each with its device current, copying
    the streams leaving one into the next one's input buffer."""
    outs = []
    for k, part in enumerate(parts):
        with on_device(part.model.device):
            outs.append(replay(part))
        if k + 1 < len(parts):
            parts[k + 1].hidden.copy_(outs[-1].hidden)
    return outs


def _check_block(state: SequenceState, width: int, block: list[int] | torch.Tensor) -> None:
    if len(block) != width:
        raise ValueError(f"a verify graph of width {width} got a block of {len(block)}")
    _check_room(state, width, "verify")


def _check_room(state: SequenceState, tokens: int, what: str) -> None:
    if state.pos + tokens > state.max_context:
        raise ValueError(f"{what} at position {state.pos} exceeds the state's {state.max_context}")


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
