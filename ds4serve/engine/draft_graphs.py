"""The draft models' passes as CUDA graphs (on CUDA unless the engine is eager).

:class:`~ds4serve.engine.drafts.MTPProposer` runs its block twice per verify step: once over the
rows the step committed (target streams and next tokens, committed to the draft's window), then
once per further draft, chained over a scratch copy of that window. Eagerly each pass is a few
hundred launches; here both are static forwards (device positions, as the decode and verify graphs)
captured once: one graph per committed-row count over the draft state, which also looks the rows' tokens
up in the embedding and writes the rows into the draft window at device positions
(:meth:`~ds4serve.engine.device_commit.DeviceCommit.write_block`), and one chained step over a
persistent scratch state that commits its own row inside the graph
(:meth:`~ds4serve.engine.device_commit.DeviceCommit.write_token`), the scratch window being reloaded
from the draft state before each chain. For a greedy request whose committed tokens the verify graph
chose, :meth:`MTPGraphs.follow` is both passes and the chain as one graph that reads the verify's buffers in
place and writes the next verify block into that verify graph's own input buffer.

The passes own their draft state and live as long as the draft weights (``DraftModels.passes``): each
speculative request holds a set of its draft kind while it runs (the draft state reset by
:meth:`MTPGraphs.reuse`), so graphs are captured once per set, not per request: a process makes as many sets
of a kind as it ran speculative requests of that kind at once.

:class:`~ds4serve.engine.drafts.DSparkProposer` runs one pass per step over its block (seed, noise
tokens), attending to each stage's context ring: statically, the whole ring with a mask of the
committed positions (:func:`~ds4serve.model.dspark.ring_context`), one graph. Its context rows of the
committed positions are one graph per row count; the ring writes stay on the host's side.

The passes run on the device of the target's head (the last shard of a layer split). Where the embedding
table lives with the first shard on another device, the rows of a pass's tokens are looked up before each
replay and copied into the graph's input buffer; the chained step and DSpark's block always do so.
"""

from __future__ import annotations

import torch

from ..config import SLIDING, ModelConfig
from ..devices import ids_on
from ..kernels import regions
from ..model.dspark import (
    DSparkWeights,
    base_logits,
    block_merged,
    context_rows,
    ring_context,
    target_features,
)
from ..model.mtp import MTPWeights, static_pass
from ..state import ChunkDelta, LayerDelta, SequenceState, allocate_layer
from .cuda_graphs import Captured
from .device_commit import DeviceCommit
from .sampler import graph_argmax

MAX_FOLLOW_GRAPHS = 64  # follow passes kept by one set of passes, before they are dropped and made anew


def draft_state(
    cfg: ModelConfig, stages: int, max_context: int, dtype: torch.dtype, device: torch.device
) -> SequenceState:
    """A draft's state: one sliding window per stage (key ``s``), sized by the window, not the context."""
    layers = {s: allocate_layer(cfg, SLIDING, max_context, dtype, device) for s in range(stages)}
    return SequenceState(layers=layers, max_context=max_context, window=cfg.sliding_window)


class _DraftPasses:
    """What both drafts' passes share: their draft state, handed to each request reset, and whether a
    request holds them (``DraftModels.passes`` hands them out, :meth:`release` gives them back)."""

    state: SequenceState
    in_use: bool = False

    def release(self) -> None:
        """The request that held these passes ended: the next one may take them."""
        self.in_use = False

    def reuse(self, max_context: int) -> SequenceState:
        """The draft state, reset for a new request of up to ``max_context`` positions."""
        if max_context > self.state.max_context:
            raise ValueError(
                f"draft passes: a request needs {max_context} positions, the passes hold {self.state.max_context}"
            )
        self.state.reset()
        return self.state


class MTPGraphs(_DraftPasses):
    """Captured passes of the MTP ``weights`` over their own draft state of ``max_context`` positions (its
    one sliding layer is key 0); the target's embedding, head and RoPE tables come from ``target``
    (:class:`~ds4serve.engine.drafts.TargetParts`). ``graph=False`` runs the same static passes uncaptured
    (CPU tests)."""

    def __init__(self, weights: MTPWeights, target: object, max_context: int, graph: bool = True):
        self.w, self.target, self.graph = weights, target, graph
        state = self.state = draft_state(target.cfg, 1, max_context, target.last.dtype, target.device)
        self.scratch = state.fork()
        self._state_writes = DeviceCommit(state)
        self._scratch_writes = DeviceCommit(self.scratch)
        cfg, dev, dtype = target.cfg, target.device, target.last.dtype
        self._rows: dict[int, tuple[Captured, torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
        self._hidden = torch.zeros(1, cfg.hc_mult, cfg.hidden_size, dtype=dtype, device=dev)
        self._embedded = torch.zeros(1, cfg.hidden_size, dtype=target.embed.dtype, device=dev)
        self._token = torch.zeros(1, dtype=torch.long, device=dev)
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._step: Captured | None = None
        # (rows, drafts, the input and block buffers' addresses) -> the follow pass over them
        self._follows: dict[tuple[int, ...], Captured] = {}
        self._follow_pool = torch.cuda.graph_pool_handle() if graph and dev.type == "cuda" else None

    def _pass(
        self,
        state: SequenceState,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, LayerDelta, torch.Tensor, torch.Tensor]:
        """Output streams, the layer delta, the last row's logits and their argmax ``[1]`` of a static pass at
        ``positions``."""
        t = self.target
        with regions.static_step():
            G, delta, logits = static_pass(
                self.w, t.last, t.head, hidden, ids, embedded, positions, state.layers[0]
            )
            return G, delta, logits[0], graph_argmax(logits)

    def observe(
        self, hidden: torch.Tensor, next_ids: list[int], ids_here: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the committed rows (``hidden [S, hc, D]`` with ``next_ids``; ``ids_here``: the same ids already
        on the drafts' device) at the draft state's position and commit them; return the last row's streams
        ``[1, hc, D]``, logits and their argmax ``[1]`` (buffers that this pass of ``S`` rows overwrites).

        One graph per ``S``: the embedding lookup (when the table is on the drafts' device), the positions and
        the window writes at them are inside it, so a replay is four launches."""
        S = len(next_ids)
        if S not in self._rows:
            self._rows[S] = self._observe_pass(S)
        run, rows_hidden, embedded, ids = self._rows[S]
        rows_hidden.copy_(hidden)
        ids.copy_(ids_on(next_ids, ids.device) if ids_here is None else ids_here)
        if embedded is not None:
            embedded.copy_(self.target.embed_rows(ids))
        self._pos.fill_(self.state.pos)
        out = run.replay()
        self.state.advance_block(next_ids)
        return out

    def _observe_pass(self, S: int) -> tuple[Captured, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The captured pass over ``S`` committed rows at ``self._pos`` and its input buffers (streams, the
        embedded rows when the table is on another device, else None, and the ids)."""
        t, dev = self.target, self._hidden.device
        rows_hidden = torch.zeros(S, *self._hidden.shape[1:], dtype=self._hidden.dtype, device=dev)
        ids = torch.zeros(S, dtype=torch.long, device=dev)
        outside = t.embed.device != dev
        embedded = (
            torch.zeros(S, self._embedded.shape[1], dtype=t.embed.dtype, device=dev) if outside else None
        )
        offsets = torch.arange(S, device=dev)

        def run(commit: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            positions = self._pos + offsets
            rows = embedded if outside else t.embed[ids]
            G, delta, logits, argmax = self._pass(self.state, rows_hidden, rows, ids, positions)
            if commit:
                self._state_writes.write_block(
                    ChunkDelta(start=0, tokens=[], layers={0: delta}), positions, S
                )
            return G[-1:], logits, argmax

        # warming up runs the pass only: it must not write the draft state
        return (
            Captured(lambda: run(True), dev, graph=self.graph, warm=lambda: run(False)),
            rows_hidden,
            embedded,
            ids,
        )

    @property
    def device(self) -> torch.device:
        """The device the passes run on, with its index (a model's own may have none)."""
        return self._pos.device

    def follow(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, next_host: list[int], block: torch.Tensor
    ) -> None:
        """:meth:`observe` of the committed rows chained with ``len(block) - 1`` greedy drafts, as one graph:
        ``hidden [S, hc, D]`` and ``next_ids [S]`` are read in place (a verify's buffers on the drafts' device;
        ``next_host``: the same ids on the host) and ``block`` receives ``[next_ids[-1], d1 .. dk]``, the next
        verify block, so that nothing waits for the host between the rows and that verify.

        One graph per row count, draft count and buffer addresses (the same buffers at every step of a
        request); the committed rows are written to the draft state, the drafts' rows to the scratch window."""
        S, k = len(next_host), block.numel() - 1
        key = (S, k, hidden.data_ptr(), next_ids.data_ptr(), block.data_ptr())
        run = self._follows.get(key)
        if run is None:
            if len(self._follows) >= MAX_FOLLOW_GRAPHS:  # verify graphs were made anew: stale addresses
                self._follows.clear()
            run = self._follows[key] = self._follow_pass(hidden, next_ids, block)
        self._pos.fill_(self.state.pos)
        run.replay()
        self.state.advance_block(next_host)

    def _follow_pass(self, hidden: torch.Tensor, ids: torch.Tensor, block: torch.Tensor) -> Captured:
        """The captured :meth:`follow` over these buffers, at ``self._pos``."""
        t, S, k = self.target, ids.shape[0], block.numel() - 1
        offsets = torch.arange(S + k - 1, device=ids.device)  # the rows', then the chained drafts' positions

        def run(commit: bool) -> None:
            positions = self._pos + offsets[:S]
            G, delta, _, token = self._pass(self.state, hidden, t.embed[ids], ids, positions)
            if commit:
                self._state_writes.write_block(
                    ChunkDelta(start=0, tokens=[], layers={0: delta}), positions, S
                )
            block[:1].copy_(ids[S - 1 :])
            block[1:2].copy_(token)
            if k > 1:
                self.scratch.layers[0].window.copy_(self.state.layers[0].window)
            G = G[-1:]
            for j in range(1, k):
                pos = positions[:1] + offsets[S + j - 1 : S + j]
                G, delta, _, token = self._pass(self.scratch, G, t.embed[token], token, pos)
                self._scratch_writes.write_block(ChunkDelta(start=0, tokens=[], layers={0: delta}), pos, 1)
                block[1 + j : 2 + j].copy_(token)

        # warming up must not write the draft state (the scratch window is reloaded by every replay)
        return Captured(
            lambda: run(True), ids.device, graph=self.graph, warm=lambda: run(False), pool=self._follow_pool
        )

    def start_chain(self) -> None:
        """Load the scratch window from the draft state before chaining drafts over it."""
        self.scratch.layers[0].window.copy_(self.state.layers[0].window)
        self.scratch.pos, self.scratch.tokens = self.state.pos, []

    def step(
        self, hidden: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chained draft after ``token`` (``[1]`` on the device, not read back) over the scratch state
        (committed there; the scratch counts positions, its token list stays empty): streams ``[1, hc, D]``,
        logits and their argmax ``[1]``."""
        if self._step is None:
            self._step = Captured(
                self._step_and_commit,
                self._hidden.device,
                graph=self.graph,
                warm=lambda: self._pass(self.scratch, self._hidden, self._embedded, self._token, self._pos),
                setup=lambda: self._scratch_writes.prepare_capture(self._pos),
            )
            self._scratch_writes.finish_capture()
        self._hidden.copy_(hidden)
        self._embedded.copy_(self.target.embed_rows(token))
        self._token.copy_(token)
        self._pos.fill_(self.scratch.pos)
        out = self._step.replay()
        self.scratch.pos += 1
        return out

    def _step_and_commit(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        G, delta, logits, argmax = self._pass(
            self.scratch, self._hidden, self._embedded, self._token, self._pos
        )
        self._scratch_writes.write_token(ChunkDelta(start=0, tokens=[], layers={0: delta}), self._pos)
        return G, logits, argmax


class DSparkGraphs(_DraftPasses):
    """Captured passes of the DSpark ``weights`` over their own draft state of ``max_context`` positions
    (one context ring per stage), reading the target features of ``weights.spec.target_layer_ids``."""

    def __init__(self, weights: DSparkWeights, target: object, max_context: int, graph: bool = True):
        self.w, self.target, self.graph = weights, target, graph
        spec, dev = weights.spec, target.device
        self.layers = tuple(spec.target_layer_ids)
        self.state = draft_state(target.cfg, len(weights.stages), max_context, target.last.dtype, dev)
        self._ids = torch.full((spec.block_size,), spec.noise_token_id, dtype=torch.long, device=dev)
        self._embedded = target.embed_rows(self._ids)  # row 0 (the seed's) is replaced before each pass
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._offsets = torch.arange(spec.block_size, device=dev)
        self._block: Captured | None = None
        self._rows: dict[int, tuple[Captured, dict[int, torch.Tensor], torch.Tensor]] = {}

    def _block_pass(self) -> tuple[torch.Tensor, torch.Tensor]:
        t, rings = self.target, [ls.window for ls in self.state.layers.values()]
        cos, sin = t.last.chunk_info(0, self._ids.shape[0], self._pos + self._offsets).rope["main"]
        merged = block_merged(
            self.w, self._ids, self._embedded, rings, cos, sin, t.cfg, ring_context(rings[0], self._pos)
        )
        return merged, base_logits(self.w, merged, t.head, t.cfg)

    def propose(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block pass after ``seed`` at the draft state's position: merged streams ``[B, D]`` and base
        logits ``[B, V]`` (buffers)."""
        if self._block is None:
            self._block = Captured(self._block_pass, self._pos.device, graph=self.graph)
        self._ids[:1].fill_(seed)
        self._embedded[:1].copy_(self.target.embed_rows([seed]))
        self._pos.fill_(self.state.pos)
        return self._block.replay()

    def context(self, captured: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Each stage's context rows ``[n, head_dim]`` for the ``n`` committed rows' captured target
        streams, at the draft state's position (buffers)."""
        n = next(iter(captured.values())).shape[0]
        if n not in self._rows:
            inputs = {layer: torch.zeros_like(captured[layer]) for layer in self.layers}
            positions = torch.zeros(n, dtype=torch.long, device=self._pos.device)

            def rows() -> list[torch.Tensor]:
                cos, sin = self.target.last.chunk_info(0, n, positions).rope["main"]
                return context_rows(self.w, target_features(inputs, self.layers), cos, sin, self.target.cfg)

            self._rows[n] = (Captured(rows, self._pos.device, graph=self.graph), inputs, positions)
        run, inputs, positions = self._rows[n]
        for layer in self.layers:
            inputs[layer].copy_(captured[layer])
        torch.arange(self.state.pos, self.state.pos + n, out=positions)
        return run.replay()
