"""DeepSeek-V4 attention for a chunk of new tokens over committed state.

Low-rank Q with a per-head unweighted norm, one shared K=V head, interleaved partial RoPE, a
learned per-head sink in the softmax denominator, inverse RoPE on the output and a grouped
low-rank output projection. Keys are the sliding window (committed ring rows + the chunk's own
rows) plus, for CSA/HCA layers, compressed entries: all visible ones for HCA, the lightning
indexer's top-k for CSA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import profiler
from ..config import CSA, SLIDING, ModelConfig
from ..state import CompressorDelta, LayerDelta, LayerState
from .compressor import CompressorWeights, compress_chunk
from .norms import rms_norm, unweighted_rms_norm
from .rope import Rope


@dataclass
class IndexerWeights:
    wq_b: torch.Tensor  # [ih*id, q_lora]
    weights_proj: torch.Tensor  # [ih, D]
    compressor: CompressorWeights


@dataclass
class AttentionWeights:
    layer_type: str
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # [groups*o_lora, H*hd/groups]
    wo_b: torch.Tensor
    sinks: torch.Tensor  # [H] fp32
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None


@dataclass
class ChunkInfo:
    """Positions of a chunk and the RoPE tables' cos/sin at those positions."""

    start: int
    positions: torch.Tensor  # [S]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main"/"compress" -> (cos, sin)


def attention(w: AttentionWeights, x: torch.Tensor, chunk: ChunkInfo, state: LayerState, cfg: ModelConfig,
              ropes: dict[str, Rope]) -> tuple[torch.Tensor, LayerDelta]:
    """Attention output ``[S, D]`` for normalised input ``x`` and the rows this chunk would commit."""
    S = x.shape[0]
    H, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    table = "main" if w.layer_type == SLIDING else "compress"
    cos, sin = chunk.rope[table]

    q_res = rms_norm(F.linear(x, w.wq_a), w.q_norm, eps)
    q = unweighted_rms_norm(F.linear(q_res, w.wq_b).view(S, H, hd), eps)
    q = Rope.apply(q, cos, sin)
    kv = Rope.apply(rms_norm(F.linear(x, w.wkv), w.kv_norm, eps), cos, sin)

    keys, allowed = _window_keys(kv, chunk, state, cfg.sliding_window)
    delta = LayerDelta(window_rows=kv)
    if w.compressor is not None:
        with profiler.phase("compressor"):
            comp = compress_chunk(w.compressor, x, chunk.start, state.compressor, ropes["compress"], eps)
        delta.compressor = comp
        entries = _all_entries(state.compressor.entries, comp)
        visible = _causal_entries(chunk.positions, entries.shape[0], state.compressor.rate)
        if w.layer_type == CSA:
            with profiler.phase("indexer"):
                delta.indexer, visible = _indexer_select(w.indexer, x, q_res, chunk, state, cfg, ropes, visible)
        keys = torch.cat([keys, entries])
        allowed = torch.cat([allowed, visible], dim=-1)

    out = _core(q, keys, allowed, w.sinks, hd ** -0.5)
    out = Rope.apply(out, cos, sin, inverse=True)
    groups = out.reshape(S, cfg.o_groups, -1)
    wo_a = w.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
    low = torch.einsum("sgi,gri->sgr", groups, wo_a).reshape(S, -1)
    return F.linear(low, w.wo_b), delta


def _window_keys(kv: torch.Tensor, chunk: ChunkInfo, state: LayerState, window: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed ring rows still in reach of the chunk, then the chunk's rows, with the window mask."""
    start = chunk.start
    first = max(0, start - window + 1)
    old_pos = torch.arange(first, start, device=kv.device)
    key_pos = torch.cat([old_pos, chunk.positions])
    keys = torch.cat([state.window[old_pos % window], kv]) if start > first else kv
    q_pos = chunk.positions.unsqueeze(-1)
    allowed = (key_pos <= q_pos) & (key_pos > q_pos - window)
    return keys, allowed


def _all_entries(committed: torch.Tensor, delta: CompressorDelta) -> torch.Tensor:
    return torch.cat([committed[: delta.first_entry], delta.entries])


def _causal_entries(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """Entry e is visible to the query at t iff e < (t + 1) // rate."""
    e = torch.arange(n_entries, device=positions.device)
    return e < ((positions + 1) // rate).unsqueeze(-1)


def _indexer_select(w: IndexerWeights, x: torch.Tensor, q_res: torch.Tensor, chunk: ChunkInfo,
                    state: LayerState, cfg: ModelConfig, ropes: dict[str, Rope], visible: torch.Tensor
                    ) -> tuple[CompressorDelta, torch.Tensor]:
    """Lightning indexer: score every visible entry, keep the top-k per query."""
    S = x.shape[0]
    delta = compress_chunk(w.compressor, x, chunk.start, state.indexer, ropes["compress"], cfg.rms_norm_eps)
    keys = _all_entries(state.indexer.entries, delta)
    n_entries = keys.shape[0]
    if n_entries == 0:
        return delta, visible
    cos, sin = chunk.rope["compress"]
    q = Rope.apply(F.linear(q_res, w.wq_b).view(S, cfg.index_n_heads, cfg.index_head_dim), cos, sin)
    scores = torch.matmul(q.float(), keys.float().t())  # [S, ih, T]
    scores = F.relu(scores) * cfg.index_head_dim ** -0.5
    head_w = F.linear(x, w.weights_proj).float() * cfg.index_n_heads ** -0.5
    scores = (scores * head_w.unsqueeze(-1)).sum(dim=1)  # [S, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(cfg.index_topk, n_entries), dim=-1).indices
    selected = torch.zeros_like(visible)
    selected.scatter_(-1, top, True)
    return delta, selected & visible


def _core(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
          scale: float) -> torch.Tensor:
    """Softmax attention of ``q [S,H,d]`` over shared K=V ``keys [K,d]`` with a per-head sink."""
    scores = torch.matmul(q.transpose(0, 1), keys.t()) * scale  # [H, S, K]
    scores = scores.masked_fill(~allowed, float("-inf")).float()
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)  # [S, H, d]
