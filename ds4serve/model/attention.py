"""DeepSeek-V4 attention for a chunk of new tokens over committed state.

Low-rank Q with a per-head unweighted norm, one shared K=V head, interleaved partial RoPE, a
learned per-head sink in the softmax denominator, inverse RoPE on the output and a grouped
low-rank output projection. Keys are the sliding window (committed ring rows + the chunk's own
rows) plus, for CSA/HCA layers, compressed entries: all visible ones for HCA, the lightning
indexer's top-k for CSA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .. import kernels, profiler
from ..config import CSA, SLIDING, ModelConfig
from ..kernels.regions import region
from ..quant import Weight
from ..state import CompressorDelta, CompressorState, LayerDelta, LayerState, OpenEntry
from .chunk_attention import chunk_attention, gathers, window_sequence
from .compressor import CompressorWeights, compress_chunk
from .linear import grouped_linear, linear
from .norms import rms_norm, unweighted_rms_norm
from .projections import Projections, concatenate
from .rope import Rope


@dataclass
class IndexerWeights:
    wq_b: Weight  # [ih*id, q_lora]
    weights_proj: Weight  # [ih, D]
    compressor: CompressorWeights


@dataclass
class AttentionWeights:
    layer_type: str
    wq_a: Weight
    q_norm: torch.Tensor
    wq_b: Weight
    wkv: Weight
    kv_norm: torch.Tensor
    wo_a: Weight  # [groups*o_lora, H*hd/groups]
    wo_b: Weight
    sinks: torch.Tensor  # [H] fp32
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None
    # The projections of the input and of q_res, concatenated per storage format by
    # :func:`concatenate_projections` (None: each part is its own product).
    x_proj: Projections | None = None
    q_proj: Projections | None = None

    def input_parts(self) -> dict[str, Weight]:
        """Every projection of the layer's normalised input, by name."""
        parts = {"wq_a": self.wq_a, "wkv": self.wkv}
        for prefix, c in self._compressors():
            if c is not None:
                parts[f"{prefix}.wkv"], parts[f"{prefix}.wgate"] = c.wkv, c.wgate
        if self.indexer is not None:
            parts["indexer.weights_proj"] = self.indexer.weights_proj
        return parts

    def _compressors(self) -> tuple[tuple[str, CompressorWeights | None], ...]:
        return ("compressor", self.compressor), (
            "indexer.compressor",
            self.indexer and self.indexer.compressor,
        )

    def q_parts(self) -> dict[str, Weight]:
        """Every projection of ``q_res``, by name."""
        return {
            "wq_b": self.wq_b,
            **({"indexer.wq_b": self.indexer.wq_b} if self.indexer is not None else {}),
        }


def concatenate_projections(w: AttentionWeights) -> None:
    """Store the input's and q_res's projections as one weight per storage format (parts become row
    views of it): a decode step then runs one GEMV per format instead of one per projection."""
    w.x_proj, views = concatenate(w.input_parts())
    w.q_proj, q_views = concatenate(w.q_parts())
    views.update(q_views)
    w.wq_a, w.wkv, w.wq_b = views["wq_a"], views["wkv"], views["wq_b"]
    for prefix, c in w._compressors():
        if c is not None:
            c.wkv, c.wgate = views[f"{prefix}.wkv"], views[f"{prefix}.wgate"]
    if w.indexer is not None:
        w.indexer.weights_proj, w.indexer.wq_b = views["indexer.weights_proj"], views["indexer.wq_b"]


@dataclass
class ChunkInfo:
    """Positions of a chunk and the RoPE tables' cos/sin at those positions.

    A ``static`` chunk is one token whose position is read only from the device tensor
    ``positions``: every shape is independent of it, so the step can be captured as a CUDA graph
    and replayed at any position (the full window ring and entry buffers are read, masked).
    """

    start: int
    positions: torch.Tensor  # [S]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main"/"compress" -> (cos, sin)
    static: bool = False


def attention(
    w: AttentionWeights,
    x: torch.Tensor,
    chunk: ChunkInfo,
    state: LayerState,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
) -> tuple[torch.Tensor, LayerDelta]:
    """Attention output ``[S, D]`` for normalised input ``x`` and the rows this chunk would commit: the
    token-wise :func:`input_products`, the state-reading :func:`attention_core`, the token-wise
    :func:`output_projection`."""
    xs, qs = input_products(w, x, cfg)
    out, delta = attention_core(w, xs, qs, chunk, state, cfg, ropes)
    return output_projection(w, out, cfg), delta


Products = tuple[
    torch.Tensor, ...
]  # one projection product per storage group, unsplit (Projections.products)


def input_products(w: AttentionWeights, x: torch.Tensor, cfg: ModelConfig) -> tuple[Products, Products]:
    """The projections of normalised input ``x [S, D]`` and of its ``q_res``, as products per storage group
    (``[S, n]`` each). Row ``s`` of them depends on ``x[s]`` alone: a batched step runs them over a tile of
    rows and gives each row's attention its own rows."""
    x_proj = _input_projections(w)
    xs = x_proj.products(x)
    q_res = rms_norm(x_proj.named(xs)["wq_a"], w.q_norm, cfg.rms_norm_eps)
    return xs, _q_projections(w).products(q_res)


def _input_projections(w: AttentionWeights) -> Projections:
    return w.x_proj or Projections.separate(w.input_parts())


def _q_projections(w: AttentionWeights) -> Projections:
    return w.q_proj or Projections.separate(w.q_parts())


def attention_core(
    w: AttentionWeights,
    xs: Products,
    qs: Products,
    chunk: ChunkInfo,
    state: LayerState,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
) -> tuple[torch.Tensor, LayerDelta]:
    """The attention of the chunk's tokens over ``state`` from their :func:`input_products` ``xs``, ``qs``:
    the output before its projection ``[S, H, hd]`` (inverse RoPE applied) and the rows the chunk would
    commit."""
    H, hd, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    table = "main" if w.layer_type == SLIDING else "compress"
    cos, sin = chunk.rope[table]
    xp, qp = _input_projections(w).named(xs), _q_projections(w).named(qs)
    q, kv, window = _queries_and_keys(
        qp["wq_b"].unflatten(-1, (H, hd)), xp["wkv"], w.kv_norm, chunk, state, eps, cos, sin
    )

    delta = LayerDelta(window_rows=kv)
    entries = visible = open_entry = None
    if w.compressor is not None:
        with profiler.phase("compressor"):
            comp = compress_chunk(
                w.compressor,
                xp["compressor.wkv"],
                xp["compressor.wgate"],
                chunk.start,
                state.compressor,
                ropes["compress"],
                eps,
                _static_pos(chunk),
            )
        delta.compressor = comp
        entries, open_entry = _all_entries(state.compressor, comp, _static_pos(chunk))
        visible = _causal_entries(chunk.positions, entries.shape[0], state.compressor.rate)
        if w.layer_type == CSA:
            with profiler.phase("indexer"):
                delta.indexer, visible = _indexer_select(w.indexer, xp, qp, chunk, state, cfg, ropes, visible)

    out = _attend_keys(q, kv, chunk, state, entries, visible, w.sinks, hd**-0.5, cos, sin, window, open_entry)
    return out, delta


def output_projection(w: AttentionWeights, out: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The grouped low-rank output projection of :func:`attention_core`'s ``out [S, H, hd]``: ``[S, D]``,
    row ``s`` from ``out[s]`` alone."""
    low = grouped_linear(out.reshape(out.shape[0], cfg.o_groups, -1), w.wo_a, cfg.o_groups)
    return linear(low, w.wo_b)


Window = tuple[torch.Tensor, torch.Tensor]  # a static step's window keys and their mask


def _queries_and_keys(
    qr: torch.Tensor,
    kv: torch.Tensor,
    kv_norm: torch.Tensor,
    chunk: ChunkInfo,
    state: LayerState,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, Window | None]:
    """``(q, kv, window)``: the query ``qr [S, H, d]`` and the key/value rows ``kv [S, d]`` normalised and
    rotated; for a one-token static step on the kernels' devices they and the window
    keys (:func:`_window_keys_static`) come from one launch, else ``window`` is None."""
    if chunk.static and qr.shape[0] == 1 and kernels.enabled(qr):
        from ..kernels import ops

        q, kv, keys, allowed = ops.attention_inputs(
            qr, kv, kv_norm, cos, sin, state.window, chunk.positions, eps
        )
        return q, kv, (keys, allowed)
    q = _rotation(chunk)(unweighted_rms_norm(qr, eps), cos, sin)
    return q, Rope.apply(rms_norm(kv, kv_norm, eps), cos, sin), None


def _rotation(chunk: ChunkInfo) -> Callable[..., torch.Tensor]:
    """The RoPE of a chunk's fresh query or attention output: in place for a prefill chunk, else the
    concatenation that a static step's compiled regions fuse."""
    return Rope.apply if chunk.static else Rope.apply_in_place


def _static_pos(chunk: ChunkInfo) -> torch.Tensor | None:
    return chunk.positions if chunk.static else None


def _attend_keys(
    q: torch.Tensor,
    kv: torch.Tensor,
    chunk: ChunkInfo,
    state: LayerState,
    entries: torch.Tensor | None,
    visible: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    window: Window | None = None,
    open_entry: OpenEntry | None = None,
) -> torch.Tensor:
    """Attention over the window (and the entries ``visible`` admits: a mask, or in a static step with
    the kernels the indexer's index slots; ``open_entry``: see :func:`_all_entries`), then the inverse RoPE.

    A static step reads the whole ring and entry buffers, masked (:func:`_attend`; ``window``: its keys and mask
    when already made); a chunk runs block-wise over the ring rows in reach and its own rows
    (:mod:`.chunk_attention`).
    """
    if chunk.static:
        keys, allowed = window or _window_keys_static(kv, chunk.positions, state.window)
        if entries is None:
            return _attend(q, [keys], [allowed], sinks, scale, cos, sin)
        return _attend(q, [keys, entries], [allowed, visible], sinks, scale, cos, sin, open_entry)
    seq = window_sequence(kv, state.window, chunk.start)
    out = chunk_attention(q, seq, chunk.start, entries, visible, sinks, scale)
    return _rotation(chunk)(out, cos, sin, inverse=True)


@region
def _window_keys_static(
    kv: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: the whole ring with its row in its slot (slot s holds the latest position = s mod W).
    A block of ``S`` tokens at ``pos [S]``: the ring (the committed positions before the block) then
    the block's rows, and per query the keys of its window ``[S, W + S]``."""
    window = ring.shape[0]
    slots = torch.arange(window, device=kv.device)
    if kv.shape[0] == 1:
        keys = torch.where((slots == pos % window).unsqueeze(-1), kv, ring)
        key_pos = pos - (pos - slots) % window
        return keys, (key_pos >= 0).unsqueeze(0)
    last = pos[:1] - 1  # the last committed position
    key_pos = torch.cat([last - (last - slots) % window, pos])
    query = pos.unsqueeze(-1)
    allowed = (key_pos >= 0) & (key_pos <= query) & (key_pos > query - window)
    return torch.cat([ring, kv]), allowed


@region
def _all_entries(
    state: CompressorState, delta: CompressorDelta, static_pos: torch.Tensor | None
) -> tuple[torch.Tensor, OpenEntry | None]:
    """Committed entries then the chunk's; static: the whole buffer with the entries of the windows
    the chunk closes in their slots (rows past a query's visible ones are masked). One token: the buffer
    as it is and the open entry, its entry (whether or not it closes the window) with its slot, which
    the attention and the indexer read in that slot's place: no copy of a buffer that at a million
    tokens holds 262,144 entries."""
    committed = state.entries
    if static_pos is None:
        return torch.cat([committed[: delta.first_entry], delta.entries]), None
    if static_pos.shape[0] == 1:
        return committed, (delta.entries, static_pos // state.rate)
    slots = torch.arange(committed.shape[0], device=committed.device)
    closer = (slots + 1) * state.rate - 1 - static_pos[:1]  # the block row that closes entry e
    closed = (closer >= 0) & (closer < static_pos.shape[0])
    entries = torch.where(
        closed.unsqueeze(-1), delta.entries[closer.clamp(0, static_pos.shape[0] - 1)], committed
    )
    return entries, None


def _with_open(entries: torch.Tensor, open_entry: OpenEntry | None) -> torch.Tensor:
    """``entries`` with the open entry in its slot (the torch path; the kernels read it in place)."""
    if open_entry is None:
        return entries
    row, at = open_entry
    slots = torch.arange(entries.shape[0], device=entries.device)
    return torch.where((slots == at).unsqueeze(-1), row, entries)


@region
def _causal_entries(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """Entry e is visible to the query at t iff e < (t + 1) // rate."""
    e = torch.arange(n_entries, device=positions.device)
    return e < ((positions + 1) // rate).unsqueeze(-1)


def _indexer_select(
    w: IndexerWeights,
    xp: dict[str, torch.Tensor],
    qp: dict[str, torch.Tensor],
    chunk: ChunkInfo,
    state: LayerState,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
    visible: torch.Tensor,
) -> tuple[CompressorDelta, torch.Tensor]:
    """Lightning indexer: score every visible entry, keep the top-k per query (``xp``/``qp``: the
    projections of the input and of q_res, by weight name)."""
    delta = compress_chunk(
        w.compressor,
        xp["indexer.compressor.wkv"],
        xp["indexer.compressor.wgate"],
        chunk.start,
        state.indexer,
        ropes["compress"],
        cfg.rms_norm_eps,
        _static_pos(chunk),
    )
    keys, open_key = _all_entries(state.indexer, delta, _static_pos(chunk))
    n_entries = keys.shape[0]
    if n_entries == 0:
        return delta, visible
    cos, sin = chunk.rope["compress"]
    q = qp["indexer.wq_b"].unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
    slots = kernels.enabled(q) if chunk.static else gathers(n_entries, cfg.index_topk)
    return delta, _index_top(
        q,
        cos,
        sin,
        keys,
        xp["indexer.weights_proj"],
        visible,
        min(cfg.index_topk, n_entries),
        slots,
        open_key,
    )


@region
def _index_top(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    slots: bool = False,
    open_key: OpenEntry | None = None,
) -> torch.Tensor:
    """The visible entries among the ``k`` best by indexer score, per query ``[S, T]``; with ``slots`` as int32
    index slots ``[S, k]`` instead (ascending, then -1), which the decode attention kernel and a gathering
    chunk (:func:`~.chunk_attention.gathers`) read. ``open_key``: the key read in its slot's place
    (:func:`_all_entries`).

    With the kernels (:mod:`ds4serve.kernels.indexer`) the per-head scores never reach memory and
    the selection needs no sort; among scores equal to the k-th largest they keep the lowest entry
    indices, where ``torch.topk`` leaves the choice unspecified.
    """
    ih, dim = q.shape[1], q.shape[2]
    q = Rope.apply(q, cos, sin)
    if kernels.enabled(q):
        from ..kernels import ops

        if slots:
            return ops.index_top_indices(q, keys, head_w, visible, k, *(open_key or ()))
        return ops.index_top(q, _with_open(keys, open_key), head_w, visible, k)
    keys = _with_open(keys, open_key)
    scores = torch.matmul(q.float(), keys.float().t())  # [S, ih, T]
    scores = F.relu(scores) * dim**-0.5
    scores = (scores * (head_w.float() * ih**-0.5).unsqueeze(-1)).sum(dim=1)  # [S, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(k, dim=-1)
    if slots:
        n = scores.shape[-1]  # the places of invisible entries sort last, then become -1
        index = torch.where(top.values > float("-inf"), top.indices, n).sort(dim=-1).values
        return torch.where(index < n, index, -1).to(torch.int32)
    selected = torch.zeros_like(visible)
    selected.scatter_(-1, top.indices, True)
    return selected & visible


@region
def _attend(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    allowed: list[torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    open_entry: OpenEntry | None = None,
) -> torch.Tensor:
    """Attention over the concatenated key parts, then the inverse RoPE of the output (``open_entry``:
    the last part's row read in its slot's place, :func:`_all_entries`).

    With the kernels (:mod:`ds4serve.kernels.decode_attention`) the parts are read in place and the
    attention is two launches instead of the cat, two products and the softmax kernels between them.
    """
    if kernels.enabled(q):
        from ..kernels import ops

        out = ops.decode_attention(q, keys, allowed, sinks, scale, *(open_entry or ()))
    else:
        keys = [*keys[:-1], _with_open(keys[-1], open_entry)]
        keys_all = torch.cat(keys) if len(keys) > 1 else keys[0]
        mask = torch.cat(allowed, dim=-1) if len(allowed) > 1 else allowed[0]
        out = _core(q, keys_all, mask, sinks, scale)
    return Rope.apply(out, cos, sin, inverse=True)


_CORE_SCORES = 1 << 28  # fp32 elements of one block of attention scores


def _core(
    q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of ``q [S,H,d]`` over shared K=V ``keys [K,d]`` with a per-head sink.

    Long chunks run in blocks of query rows so that the fp32 scores stay under ~1 GiB.
    """
    rows = max(1, _CORE_SCORES // (q.shape[1] * keys.shape[0]))
    if q.shape[0] > rows:
        return torch.cat(
            [
                _core(q[i : i + rows], keys, allowed[i : i + rows], sinks, scale)
                for i in range(0, q.shape[0], rows)
            ]
        )
    scores = torch.matmul(q.transpose(0, 1), keys.t()) * scale  # [H, S, K]
    scores = scores.masked_fill(~allowed, float("-inf")).float()
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(keys.dtype)
    # rows no query may see are stale buffer rows in a static step: selected out, not multiplied by a zero
    # probability, so that whatever they hold (another sequence's values, a non-finite one) cannot reach
    # the output
    values = keys.masked_fill(~allowed.any(dim=0).unsqueeze(-1), 0)
    return torch.matmul(probs, values).transpose(0, 1)  # [S, H, d]
