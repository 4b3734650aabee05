"""The learned KV compressors of CSA (ratio 4, overlapping windows) and HCA (ratio 128).

A compressor turns each closed window of ``rate`` tokens into one entry: a per-channel softmax
over the window's slots of the gate (+ learned position bias) weights the projected kv, then an
RMSNorm and RoPE at the window's first position. CSA windows also see the previous window's
first half (8 slots, stride 4); for the very first window those slots have weight 0.

:func:`compress_chunk` reads the committed buffers and returns a :class:`CompressorDelta` with the
entries of every window the chunk closes, so later queries of the same chunk see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.regions import region
from ..quant import Weight
from ..state import CompressorDelta, CompressorState
from .norms import rms_norm
from .rope import Rope


@dataclass
class CompressorWeights:
    wkv: Weight  # [width, D]
    wgate: Weight  # [width, D]
    ape: torch.Tensor  # [rate, width] fp32 position bias
    norm: torch.Tensor  # [dim] fp32


def compress_chunk(
    w: CompressorWeights,
    kv: torch.Tensor,
    gate: torch.Tensor,
    start: int,
    state: CompressorState,
    rope: Rope,
    eps: float,
    static_pos: torch.Tensor | None = None,
) -> CompressorDelta:
    """Pool every window that closes, given the chunk's projections ``kv = x @ wkv.T`` and
    ``gate = x @ wgate.T`` (``[S, width]``, positions ``start..``; the caller projects, so that
    projections of the same input can share one product).

    ``static_pos`` (the chunk's positions as a device tensor) selects a path whose shapes do not
    depend on the position (CUDA graphs): :func:`_pool_token` for one token, :func:`_pool_static`
    for a verify block.
    """
    if static_pos is not None:
        pool = _pool_token if kv.shape[0] == 1 else _pool_static
        rows_kv, rows_gate, entries = pool(kv, gate, static_pos, w, state, rope, eps)
        return CompressorDelta(rows_kv, rows_gate, entries, start // state.rate)
    rate, overlap = state.rate, state.overlap
    first_entry, buffered = divmod(start, rate)
    positions = torch.arange(start, start + kv.shape[0], device=kv.device)
    gate = gate.float() + w.ape[positions % rate]
    rows_kv = torch.cat([state.buf_kv[:buffered], kv]) if buffered else kv
    rows_gate = torch.cat([state.buf_gate[:buffered], gate]) if buffered else gate
    n_windows = rows_kv.shape[0] // rate
    dim = w.norm.shape[0]
    if n_windows == 0:
        entries = kv.new_zeros((0, dim))
        return CompressorDelta(rows_kv, rows_gate, entries, first_entry)

    win_kv = rows_kv[: n_windows * rate].view(n_windows, rate, -1)
    win_gate = rows_gate[: n_windows * rate].view(n_windows, rate, -1)
    if overlap:
        slot_kv = win_kv.new_zeros((n_windows, 2 * rate, dim))
        slot_gate = win_gate.new_full((n_windows, 2 * rate, dim), float("-inf"))
        slot_kv[:, rate:] = win_kv[..., dim:]
        slot_gate[:, rate:] = win_gate[..., dim:]
        if n_windows > 1:
            slot_kv[1:, :rate] = win_kv[:-1, :, :dim]
            slot_gate[1:, :rate] = win_gate[:-1, :, :dim]
        if first_entry > 0:  # the last committed window's first half
            slot_kv[0, :rate] = state.ov_kv
            slot_gate[0, :rate] = state.ov_gate
        win_kv, win_gate = slot_kv, slot_gate
    pooled = (win_kv * win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)).sum(dim=1)
    entries = rms_norm(pooled, w.norm, eps)
    entry_pos = (torch.arange(n_windows, device=kv.device) + first_entry) * rate
    cos, sin = rope.cos_sin(entry_pos, entries.dtype)
    entries = Rope.apply(entries, cos, sin)
    return CompressorDelta(rows_kv, rows_gate, entries, first_entry)


@region
def _pool_token(
    kv: torch.Tensor,
    gate: torch.Tensor,
    pos: torch.Tensor,
    w: CompressorWeights,
    state: CompressorState,
    rope: Rope,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token at device position ``pos``: the open window's rows (``[rate, width]``, this token's
    row in its slot; commit reads the first ``pos % rate + 1``) and the entry the window gives if this
    token closes it (masked out by the caller and not committed otherwise)."""
    rate, dim = state.rate, w.norm.shape[0]
    slot = pos % rate
    gate = gate.float() + w.ape[slot]
    here = (torch.arange(rate, device=kv.device) == slot).unsqueeze(-1)
    rows_kv = torch.where(here, kv, state.buf_kv)
    rows_gate = torch.where(here, gate, state.buf_gate)
    win_kv, win_gate = rows_kv, rows_gate
    if state.overlap:  # the previous window's first half; none before the first window closes (selected out)
        first = pos < rate
        win_kv = torch.cat([torch.where(first, 0, state.ov_kv), rows_kv[:, dim:]])
        win_gate = torch.cat([torch.where(first, float("-inf"), state.ov_gate), rows_gate[:, dim:]])
    pooled = (win_kv * win_gate.softmax(dim=0, dtype=torch.float32).to(win_kv.dtype)).sum(dim=0, keepdim=True)
    entry = rms_norm(pooled, w.norm, eps)
    cos, sin = rope.cos_sin(pos - slot, entry.dtype)
    return rows_kv, rows_gate, Rope.apply(entry, cos, sin)


@region
def _pool_static(
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    w: CompressorWeights,
    state: CompressorState,
    rope: Rope,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of ``S`` tokens at device positions ``positions`` (consecutive): the chunk's own rows
    (``[S, width]``, gate with the position bias) and, per token, the entry of the window it closes
    (``[S, dim]``; rows of tokens that close none are never read). A window's rows come from the
    committed open window (positions before the block) or the block; a CSA window's previous half from
    the overlap buffer, the open window or the block, by position."""
    rate, dim = state.rate, w.norm.shape[0]
    S = kv.shape[0]
    p0 = positions[:1]
    gate = gate.float() + w.ape[positions % rate]
    offsets = torch.arange(rate, device=kv.device)
    t = positions.unsqueeze(-1) - rate + 1 + offsets  # [S, rate]: the window that token i closes
    in_block = t >= p0
    here = torch.where(in_block, rate + t - p0, t % rate)  # into [open window rows; block rows]
    win_kv = torch.cat([state.buf_kv, kv])[here]
    win_gate = torch.cat([state.buf_gate, gate])[here]
    if state.overlap:
        u = t - rate  # the previous window: overlap buffer, open window or block
        open_start = p0 - p0 % rate
        src = torch.where(u >= p0, 2 * rate + u - p0, torch.where(u >= open_start, rate + u % rate, u % rate))
        prev_kv = torch.cat([state.ov_kv, state.buf_kv[:, :dim], kv[:, :dim]])[src]
        prev_gate = torch.cat([state.ov_gate, state.buf_gate[:, :dim], gate[:, :dim]])[src]
        started = (u >= 0).unsqueeze(-1)  # before position 0 there is no previous half: selected out
        prev_kv = torch.where(started, prev_kv, 0)
        prev_gate = torch.where(started, prev_gate, float("-inf"))
        win_kv = torch.cat([prev_kv, win_kv[..., dim:]], dim=1)
        win_gate = torch.cat([prev_gate, win_gate[..., dim:]], dim=1)
    pooled = (win_kv * win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)).sum(dim=1)
    entries = rms_norm(pooled, w.norm, eps)
    cos, sin = rope.cos_sin(positions - rate + 1, entries.dtype)
    return kv, gate, Rope.apply(entries.view(S, dim), cos, sin)
