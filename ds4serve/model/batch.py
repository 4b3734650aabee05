"""Batched decode: one new token for each of N sequences, each row bitwise what it is in any batch.

:func:`decode_batch` runs the rows in tiles of exactly ``ROW_TILE``; the last tile is filled with padding rows
(token 0, attention output zeros, results discarded). Every token-wise part (the embedding, the mHC sites, the
MoE router and shared expert, the attention's projections, the head) runs on the whole tile, whose shape
never changes, so a row's bits do not depend on how many rows run, which ones, or where it sits. The
attention's core (:func:`~ds4serve.model.attention.attention_core`, what reads the state) runs row by row,
each exactly a batch of one's (the row's own state, position and
:class:`~ds4serve.model.attention.ChunkInfo`); on a GPU each row of a tile runs it on a stream of its own,
so that the rows' small kernels overlap (what each kernel computes is unchanged). The step goes layer by
layer over all its tiles, so that the routed and shared experts of every real row run in one launch
(:func:`~ds4serve.model.moe.batch_experts`), each row's result its own; padding rows' experts are not run.
A lone sequence is a batch of one: it runs through a tile too. Like :meth:`DeepSeekV4.forward` this writes
nothing; the caller commits each row's :class:`~ds4serve.state.ChunkDelta`.

With ``positions`` the step is *static*, as :meth:`DeepSeekV4.forward`'s: each row's attention is the
one-token static step of the CUDA-graph path (its position read from a device tensor, its state's buffers read
whole, masked), nothing reads a host position or synchronises, so the step can be captured
(:mod:`ds4serve.engine.batch_graphs`).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .. import profiler
from ..config import ModelConfig
from ..kernels import regions
from ..kernels.regions import region
from ..state import ChunkDelta, LayerDelta, SequenceState
from .attention import AttentionWeights, ChunkInfo, attention_core, input_products, output_projection
from .deepseek4 import BlockWeights, DeepSeekV4, PendingMerge, attention_site, block_end, ffn_site
from .hyper import fused_sites
from .moe import batch_experts, route
from .rope import Rope

ROW_TILE = 8  # rows per tile: every token-wise op of a batched step runs on exactly this many rows


def micro_batches(rows: int) -> list[tuple[int, int]]:
    """A batched step's rows as two micro-batches ``[(start, stop), ...]`` for the stages of a split model
    to work on at once: halves cut at a multiple of ``ROW_TILE`` (so that no half adds a padded tile), one
    when a tile holds them all. A row's results are the same in either (the tile rule)."""
    tiles = -(-rows // ROW_TILE)
    if tiles < 2:
        return [(0, rows)]
    cut = -(-tiles // 2) * ROW_TILE
    return [(0, cut), (cut, rows)]


@dataclass
class BatchForward:
    logits: torch.Tensor | None  # [N, V] float32, row r = after token_ids[r] on states[r]; None: no head
    # row r's one-token delta at states[r].pos; commit it with states[r].commit(delta, 1)
    deltas: list[ChunkDelta]
    hidden: torch.Tensor  # [N, hc, D] streams after the range's last layer (before the head's merge)
    choices: torch.Tensor | None = None  # [N] long: each logits row's argmax, where a captured step took it


Row = tuple[SequenceState, ChunkInfo] | None  # a sequence's state and its token's position; None: padding


def decode_batch(
    model: DeepSeekV4,
    token_ids: Sequence[int] | torch.Tensor,
    states: Sequence[SequenceState],
    *,
    hidden: torch.Tensor | None = None,
    positions: Sequence[torch.Tensor] | None = None,
) -> BatchForward:
    """Forward ``token_ids[r]`` at ``states[r].pos`` for every row ``r`` over the model's layer range.

    ``hidden [N, hc, D]``: the incoming streams when the range does not start at layer 0. Rows are
    independent: a row's logits and delta are bit-identical whatever the other rows, their number and order.
    ``positions`` makes the step static (module docstring): one device tensor ``[1]`` per row holding its
    state's position, ``token_ids`` a device tensor ``[N]``; the deltas' starts are then 0 and their tokens
    empty (the caller knows them, as for a static :meth:`DeepSeekV4.forward`) and the caller checks the room.
    Raises ValueError for mismatched lengths, no rows, a state given twice or one without room for a token.
    """
    static = positions is not None
    n = len(token_ids)
    host = None if static else [int(t) for t in token_ids]
    ids = torch.as_tensor(token_ids if static else host, dtype=torch.long, device=model.device)
    _validate(model, n, states, hidden, positions)
    tiles: list[_Tile] = []
    with regions.static_step() if static else nullcontext():
        for start in range(0, n, ROW_TILE):
            tile_states = states[start : start + ROW_TILE]
            real = len(tile_states)
            pad = ROW_TILE - real
            tile_ids = torch.cat([ids[start : start + real], ids.new_zeros(pad)])
            rows: list[Row] = [
                (s, model.chunk_info(0, 1, positions[start + r]) if static else model.chunk_info(s.pos, 1))
                for r, s in enumerate(tile_states)
            ] + [None] * pad
            if model.embed is not None:
                X = model.streams(tile_ids)
            else:
                part = hidden[start : start + real].to(device=model.device, dtype=model.dtype)
                X = torch.cat([part, part.new_zeros(pad, *part.shape[1:])])
            tiles.append(_Tile(X, tile_ids, rows, real))
        for i in model.layers:
            # as in DeepSeekV4.forward: the closing merge joins the next block's first site when that is one launch
            defer = i != model.layers[-1] and fused_sites(tiles[0].X)
            _batch_block(model.blocks[i], i, tiles, model.cfg, model.ropes, defer)
        logits = [model.logits(t.X)[: t.real] for t in tiles] if model.head is not None else []
    deltas = []
    for t, start in zip(tiles, range(0, n, ROW_TILE)):
        for r, (s, _) in enumerate(t.rows[: t.real]):
            layers = {i: t.deltas[i][r] for i in model.layers}
            if static:
                deltas.append(ChunkDelta(start=0, tokens=[], layers=layers))
            else:
                deltas.append(ChunkDelta(start=s.pos, tokens=[host[start + r]], layers=layers))
    return BatchForward(
        logits=torch.cat(logits) if logits else None,
        deltas=deltas,
        hidden=torch.cat([t.X[: t.real] for t in tiles]),
    )


@dataclass
class _Tile:
    """``ROW_TILE`` rows of a step as they go through the layers: the mHC streams, the rows' token ids, each
    row's state and position (None: padding, after the ``real`` rows), the merge a block left to the next,
    and per layer each row's delta."""

    X: torch.Tensor  # [ROW_TILE, hc, D]
    ids: torch.Tensor  # [ROW_TILE]
    rows: list[Row]
    real: int
    pending: PendingMerge | None = None
    deltas: dict[int, list[LayerDelta | None]] = field(default_factory=dict)


def _validate(
    model: DeepSeekV4,
    n: int,
    states: Sequence[SequenceState],
    hidden: torch.Tensor | None,
    positions: Sequence[torch.Tensor] | None,
) -> None:
    if n != len(states):
        raise ValueError(f"token_ids and states: expected one token per state, got {n} and {len(states)}")
    if not n:
        raise ValueError("token_ids: expected at least one row")
    if positions is not None and len(positions) != n:
        raise ValueError(f"positions: expected one per row, got {len(positions)} for {n} rows")
    seen: set[int] = set()
    for r, s in enumerate(states):
        if id(s) in seen:
            raise ValueError(f"states[{r}]: a state appears twice in the batch")
        seen.add(id(s))
        if positions is None and s.pos + 1 > s.max_context:
            raise ValueError(f"states[{r}]: full ({s.pos} of {s.max_context} tokens), no room for one more")
    if model.embed is None:
        want = (n, model.cfg.hc_mult, model.cfg.hidden_size)
        if hidden is None:
            raise ValueError(f"layer range {model.layers.start}.. needs the incoming hidden streams")
        if tuple(hidden.shape) != want:
            raise ValueError(f"hidden: expected shape {want}, got {tuple(hidden.shape)}")


def _batch_block(
    b: BlockWeights,
    layer: int,
    tiles: list[_Tile],
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    defer: bool,
) -> None:
    """One decoder block over every tile (the phases of :func:`~ds4serve.model.deepseek4.block_forward`):
    each tile's sites, attention and routing, then the routed and shared experts of all real rows in one
    call (:func:`~ds4serve.model.moe.batch_experts`), then each tile's block end. In a static step the tiles'
    sites and each row's attention core run as compiled regions, as a static block's do."""
    static = any(row is not None and row[1].static for row in tiles[0].rows)
    site, mix, end = (
        (_static_site, _static_ffn_site, _static_end) if static else (attention_site, ffn_site, block_end)
    )
    ffn_inputs = []
    for t in tiles:
        X, post, comb, x = site(b, t.X, t.pending, cfg)
        with profiler.phase("attention"):
            a, t.deltas[layer] = _tile_attention(b.attn, layer, x, t.rows, t.real, cfg, ropes, static)
        X, post, comb, x = mix(b, X, a, post, comb, cfg)
        weights, idx = route(b.moe, x, t.ids, cfg.top_k, cfg.routed_scaling_factor)
        ffn_inputs.append((X, post, comb, x, weights, idx))
    with profiler.phase("moe_ffn"):
        # a deferred merge sums the MoE's slot terms itself: one launch less
        real = sum(t.real for t in tiles)
        ms = batch_experts(b.moe, [f[3:] for f in ffn_inputs], cfg.swiglu_limit, real, slot_terms=defer)
    for t, (X, post, comb, *_), m in zip(tiles, ffn_inputs, ms):
        t.X, t.pending = end(X, m, post, comb, defer)


_static_site = region(attention_site)
_static_ffn_site = region(ffn_site)
_static_end = region(block_end)
_static_products = region(input_products)
_static_core = region(attention_core)
_static_output = region(output_projection)


def _tile_attention(
    w: AttentionWeights,
    layer: int,
    x: torch.Tensor,
    rows: list[Row],
    real: int,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    static: bool,
) -> tuple[torch.Tensor, list[LayerDelta | None]]:
    """The tile's attention ``[ROW_TILE, D]``: its projections over the whole tile (each weight read once a
    tile), each row's core over its own state as a batch of one's; the padding rows (after the ``real`` ones)
    have core outputs of zeros."""
    xs, qs = (_static_products if static else input_products)(w, x, cfg)
    outs, deltas = [], []
    for r, (state, chunk), stream in zip(range(real), rows, _fork(x, real)):
        with stream:
            # fresh copies: a row's inputs never depend on where it sits in the tile (offset, alignment)
            mine = [tuple(y[r : r + 1].clone() for y in ys) for ys in (xs, qs)]
            out, delta = (_static_core if static else attention_core)(
                w, *mine, chunk, state.layers[layer], cfg, ropes
            )
        outs.append(out)
        deltas.append(delta)
    _join(x, real)
    outs.append(x.new_zeros(len(rows) - real, cfg.num_heads, cfg.head_dim))
    deltas += [None] * (len(rows) - real)
    return (_static_output if static else output_projection)(w, torch.cat(outs), cfg), deltas


@functools.cache
def _row_streams(device: torch.device) -> list[torch.cuda.Stream]:
    return [torch.cuda.Stream(device) for _ in range(ROW_TILE)]


def _fork(x: torch.Tensor, rows: int) -> list[AbstractContextManager]:
    """A context per row of a tile: on a GPU the row's own stream, which first waits for what the current
    stream has queued (the tile's products); elsewhere nothing. :func:`_join` ends the fork."""
    if not x.is_cuda:
        return [nullcontext()] * rows
    streams = _row_streams(x.device)[:rows]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream(x.device))
    return [torch.cuda.stream(s) for s in streams]


def _join(x: torch.Tensor, rows: int) -> None:
    """The current stream waits for the rows' streams of :func:`_fork`: what follows sees their results."""
    if x.is_cuda:
        for s in _row_streams(x.device)[:rows]:
            torch.cuda.current_stream(x.device).wait_stream(s)
