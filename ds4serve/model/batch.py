"""Batched decode: one new token for each of N sequences, each row bitwise what it is in any batch.

:func:`decode_batch` runs the rows in tiles of exactly ``ROW_TILE``; the last tile is filled with padding rows
(token 0, attention output zeros, results discarded). Every token-wise part (the embedding, the mHC sites, the
MoE router and shared expert, the attention's projections, the head) runs on the whole tile, whose shape
never changes, so a row's bits do not depend on how many rows run, which ones, or where it sits. The
attention's core (:func:`~ds4serve.model.attention.attention_core`, what reads the state) runs row by row,
each exactly a batch of one's (the row's own state, position and
:class:`~ds4serve.model.attention.ChunkInfo`); the routed
experts run so that a row's shapes never depend on the other rows, and not at all for padding rows
(:func:`~ds4serve.model.moe.moe` ``rows``).
A lone sequence is a batch of one: it runs through a tile too. Like :meth:`DeepSeekV4.forward` this writes
nothing; the caller commits each row's :class:`~ds4serve.state.ChunkDelta`.

With ``positions`` the step is *static*, as :meth:`DeepSeekV4.forward`'s: each row's attention is the
one-token static step of the CUDA-graph path (its position read from a device tensor, its state's buffers read
whole, masked), nothing reads a host position or synchronises, so the step can be captured
(:mod:`ds4serve.engine.batch_graphs`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
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
from .moe import moe
from .rope import Rope

ROW_TILE = 8  # rows per tile: every token-wise op of a batched step runs on exactly this many rows


@dataclass
class BatchForward:
    logits: torch.Tensor | None  # [N, V] float32, row r = after token_ids[r] on states[r]; None: no head
    # row r's one-token delta at states[r].pos; commit it with states[r].commit(delta, 1)
    deltas: list[ChunkDelta]
    hidden: torch.Tensor  # [N, hc, D] streams after the range's last layer (before the head's merge)


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
    logits, streams, deltas = [], [], []
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
            X, layer_deltas = _tile_forward(model, X, tile_ids, rows)
            if model.head is not None:
                logits.append(model.logits(X)[:real])
            streams.append(X[:real])
            for r, s in enumerate(tile_states):
                layers = {i: layer_deltas[i][r] for i in model.layers}
                if static:
                    deltas.append(ChunkDelta(start=0, tokens=[], layers=layers))
                else:
                    deltas.append(ChunkDelta(start=s.pos, tokens=[host[start + r]], layers=layers))
    return BatchForward(
        logits=torch.cat(logits) if logits else None, deltas=deltas, hidden=torch.cat(streams)
    )


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


def _tile_forward(
    model: DeepSeekV4, X: torch.Tensor, ids: torch.Tensor, rows: list[Row]
) -> tuple[torch.Tensor, dict[int, list[LayerDelta | None]]]:
    """Streams ``X [ROW_TILE, hc, D]`` through the layer range: ``(X, per layer each row's delta)``."""
    deltas: dict[int, list[LayerDelta | None]] = {}
    pending = None
    for i in model.layers:
        # as in DeepSeekV4.forward: the closing merge joins the next block's first site when that is one launch
        defer = i != model.layers[-1] and fused_sites(X)
        X, deltas[i], pending = _tile_block(
            model.blocks[i], i, X, ids, rows, model.cfg, model.ropes, pending, defer
        )
    return X, deltas


def _tile_block(
    b: BlockWeights,
    layer: int,
    X: torch.Tensor,
    ids: torch.Tensor,
    rows: list[Row],
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    pending: PendingMerge | None,
    defer: bool,
) -> tuple[torch.Tensor, list[LayerDelta | None], PendingMerge | None]:
    """One decoder block over a tile (the phases of :func:`~ds4serve.model.deepseek4.block_forward`). In a
    static step the tile's sites and each row's attention run as compiled regions, as a static block does."""
    static = any(row is not None and row[1].static for row in rows)
    X, post, comb, x = (_static_site if static else attention_site)(b, X, pending, cfg)
    with profiler.phase("attention"):
        a, deltas = _tile_attention(b.attn, layer, x, rows, cfg, ropes, static)
    real = sum(row is not None for row in rows)  # the padding rows come last
    X, pending = (_static_ffn if static else _ffn)(b, X, a, post, comb, ids, cfg, defer, real)
    return X, deltas, pending


def _ffn(
    b: BlockWeights,
    X: torch.Tensor,
    a: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    ids: torch.Tensor,
    cfg: ModelConfig,
    defer: bool,
    real: int,
) -> tuple[torch.Tensor, PendingMerge | None]:
    """The tile's second mHC site, its MoE (each row's result its own; the ``real`` rows' experts only) and
    the block's end."""
    X, post, comb, x = ffn_site(b, X, a, post, comb, cfg)
    with profiler.phase("moe_ffn"):
        m = moe(
            b.moe, x, ids, cfg.top_k, cfg.routed_scaling_factor, cfg.swiglu_limit, slot_terms=defer, rows=real
        )
    return block_end(X, m, post, comb, defer)


_static_site = region(attention_site)
_static_ffn = region(_ffn)
_static_products = region(input_products)
_static_core = region(attention_core)
_static_output = region(output_projection)


def _tile_attention(
    w: AttentionWeights,
    layer: int,
    x: torch.Tensor,
    rows: list[Row],
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    static: bool,
) -> tuple[torch.Tensor, list[LayerDelta | None]]:
    """The tile's attention ``[ROW_TILE, D]``: its projections over the whole tile (each weight read once a
    tile), each row's core over its own state as a batch of one's; a padding row's core output is zeros."""
    xs, qs = (_static_products if static else input_products)(w, x, cfg)
    outs, deltas = [], []
    for r, row in enumerate(rows):
        if row is None:
            outs.append(x.new_zeros(1, cfg.num_heads, cfg.head_dim))
            deltas.append(None)
            continue
        state, chunk = row
        # fresh copies: a row's inputs never depend on where it sits in the tile (offset, alignment)
        mine = [tuple(y[r : r + 1].clone() for y in ys) for ys in (xs, qs)]
        out, delta = (_static_core if static else attention_core)(
            w, *mine, chunk, state.layers[layer], cfg, ropes
        )
        outs.append(out)
        deltas.append(delta)
    return (_static_output if static else output_projection)(w, torch.cat(outs), cfg), deltas
