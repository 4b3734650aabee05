"""Per-sequence inference state: everything a forward reads that earlier tokens wrote.

Per layer:

* the sliding-window ring of K=V rows (``sliding_window`` slots, slot = position mod window);
* for CSA and HCA layers a :class:`CompressorState` (the CSA indexer has a second one): the raw
  projections of the still-open window, the previous closed window's first half (CSA overlap),
  and all compressed entries emitted so far.

All tensors are allocated once for the sequence's maximum context. Counters are derived from the
single committed position ``pos``: a layer with ratio ``m`` has ``pos // m`` entries and
``pos % m`` buffered rows. A forward never writes here; :meth:`SequenceState.commit` applies a
forward's :class:`ChunkDelta` for its first ``n`` tokens. A CUDA graph commits through device writes
instead (:mod:`ds4serve.engine.device_commit`), then :meth:`SequenceState.advance_block`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import CSA, SLIDING, ModelConfig


@dataclass
class CompressorState:
    rate: int
    overlap: bool
    buf_kv: torch.Tensor  # [rate, width] raw kv projections of the open window
    buf_gate: torch.Tensor  # [rate, width] fp32 gate projections + position bias
    ov_kv: torch.Tensor | None  # [rate, dim] first half of the last closed window (CSA)
    ov_gate: torch.Tensor | None  # [rate, dim] fp32
    entries: torch.Tensor  # [capacity, dim] compressed entries

    @classmethod
    def allocate(
        cls, rate: int, overlap: bool, dim: int, capacity: int, dtype: torch.dtype, device: torch.device | str
    ) -> "CompressorState":
        width = 2 * dim if overlap else dim
        return cls(
            rate=rate,
            overlap=overlap,
            buf_kv=torch.zeros(rate, width, dtype=dtype, device=device),
            buf_gate=torch.zeros(rate, width, dtype=torch.float32, device=device),
            ov_kv=torch.zeros(rate, dim, dtype=dtype, device=device) if overlap else None,
            ov_gate=torch.zeros(rate, dim, dtype=torch.float32, device=device) if overlap else None,
            entries=torch.zeros(capacity, dim, dtype=dtype, device=device),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [
            t for t in (self.buf_kv, self.buf_gate, self.ov_kv, self.ov_gate, self.entries) if t is not None
        ]


@dataclass
class LayerState:
    window: torch.Tensor  # [sliding_window, head_dim] K=V ring
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def compressors(self) -> list[CompressorState]:
        return [c for c in (self.compressor, self.indexer) if c is not None]


@dataclass(eq=False)
class SequenceState:
    """The state of one sequence over a range of layers (a whole model or one shard)."""

    layers: dict[int, LayerState]
    max_context: int
    window: int
    pos: int = 0
    last_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, layers: range, max_context: int, dtype: torch.dtype, device: torch.device | str
    ) -> "SequenceState":
        out: dict[int, LayerState] = {}
        for layer in layers:
            out[layer] = allocate_layer(cfg, cfg.layer_types[layer], max_context, dtype, device)
        return cls(layers=out, max_context=max_context, window=cfg.sliding_window)

    def part(self, layers: range) -> "SequenceState":
        """The state of ``layers`` only, over the same tensors: a shard's share of a layer split's state,
        for the shard's graphs (their device writes go to its layers); its host counters are not advanced,
        the whole state's are."""
        return SequenceState(
            layers={i: self.layers[i] for i in layers},
            max_context=self.max_context,
            window=self.window,
            pos=self.pos,
        )

    def commit(self, delta: "ChunkDelta", n: int, skip: int = 0) -> None:
        """Append tokens ``skip .. skip + n`` of a forward's chunk (verify-then-commit). A chunk may be
        committed in parts, each where the last one ended: ``commit(delta, k)`` then
        ``commit(delta, n, skip=k)`` leaves what ``commit(delta, k + n)`` leaves."""
        if skip:
            delta = self._suffix(delta, skip)
        if delta.start != self.pos:
            raise ValueError(f"chunk starts at {delta.start} but the state is at {self.pos}")
        if not 0 <= n <= delta.length:
            raise ValueError(f"cannot commit {n} of a {delta.length}-token chunk")
        if self.pos + n > self.max_context:
            raise ValueError(f"committing {n} tokens at {self.pos} exceeds the context of {self.max_context}")
        for idx, ld in delta.layers.items():
            ls = self.layers[idx]
            slots = torch.arange(self.pos, self.pos + n, device=ls.window.device) % self.window
            if n > self.window:  # only the last `window` rows survive; write those once
                slots, rows = slots[-self.window :], ld.window_rows[n - self.window : n]
            else:
                rows = ld.window_rows[:n]
            ls.window[slots] = rows
            for c, cd in ((ls.compressor, ld.compressor), (ls.indexer, ld.indexer)):
                if cd is not None:
                    _commit_compressor(c, cd, self.pos, n)
        self.pos += n
        self.tokens.extend(delta.tokens[:n])

    def _suffix(self, delta: "ChunkDelta", k: int) -> "ChunkDelta":
        """The delta of ``delta``'s tokens from the ``k``-th on, as a chunk of their own would give it."""
        if not 0 <= k <= delta.length:
            raise ValueError(f"cannot skip {k} tokens of a {delta.length}-token chunk")
        start = delta.start + k
        layers = {}
        for idx, ld in delta.layers.items():
            ls = self.layers[idx]
            parts = {}
            for name, c in (("compressor", ls.compressor), ("indexer", ls.indexer)):
                cd = getattr(ld, name)
                if cd is not None:
                    first = start // c.rate
                    drop = first - cd.first_entry  # whole windows closed before the suffix
                    rows = slice(drop * c.rate, None)
                    parts[name] = CompressorDelta(
                        cd.rows_kv[rows], cd.rows_gate[rows], cd.entries[drop:], first
                    )
            layers[idx] = LayerDelta(window_rows=ld.window_rows[k:], **parts)
        return ChunkDelta(start=start, tokens=delta.tokens[k:], layers=layers)

    def commit_static(self, delta: "ChunkDelta", tokens: list[int]) -> None:
        """:meth:`commit` of the first ``len(tokens)`` tokens (``tokens``) of a static block (a forward
        with ``positions`` of several tokens, e.g. a captured verify step), whose compressor deltas
        hold the block's own rows and one entry per token (that of the window it closes): rebuilt
        here, with the host position, into the chunk form :meth:`commit` applies."""
        layers = {}
        for idx, ld in delta.layers.items():
            ls = self.layers[idx]
            fixed = {}
            for name, c in (("compressor", ls.compressor), ("indexer", ls.indexer)):
                cd = getattr(ld, name)
                if cd is not None:
                    fixed[name] = _chunk_form(c, cd, self.pos, ld.window_rows.shape[0])
            layers[idx] = LayerDelta(window_rows=ld.window_rows, **fixed)
        self.commit(ChunkDelta(start=self.pos, tokens=list(tokens), layers=layers), len(tokens))

    def advance_block(self, tokens: list[int]) -> None:
        """The host half of committing ``tokens`` whose rows were written at device positions
        (:class:`~ds4serve.engine.device_commit.DeviceCommit`): the position and the token ids."""
        if self.pos + len(tokens) > self.max_context:
            raise ValueError(
                f"committing {len(tokens)} token(s) at {self.pos} exceeds the context of {self.max_context}"
            )
        self.pos += len(tokens)
        self.tokens.extend(tokens)

    def advance(self, token: int) -> None:
        """:meth:`advance_block` of one token."""
        self.advance_block([token])

    def reset(self) -> None:
        """Forget everything: the next forward starts at position 0. Buffers are reused, not freed."""
        self.pos = 0
        self.last_logits = None
        self.tokens = []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._all_tensors())

    def _all_tensors(self) -> list[torch.Tensor]:
        out = []
        for ls in self.layers.values():
            out.append(ls.window)
            for c in ls.compressors():
                out.extend(c.tensors())
        return out

    # ---- snapshots -----------------------------------------------------------------------------
    def snapshot(self, device: torch.device | str | None = None) -> "Snapshot":
        """A right-sized copy of the committed state (``device`` defaults to the state's own)."""
        layers: dict[int, dict[str, torch.Tensor]] = {}
        rows = min(self.pos, self.window)
        for idx, ls in self.layers.items():
            saved = {"window": _copy(ls.window[_ring_slots(self.pos, rows, self.window)], device)}
            for name, c in (("compressor", ls.compressor), ("indexer", ls.indexer)):
                if c is None:
                    continue
                n_entries, n_buf = divmod(self.pos, c.rate)
                saved[f"{name}.entries"] = _copy(c.entries[:n_entries], device)
                saved[f"{name}.buf_kv"] = _copy(c.buf_kv[:n_buf], device)
                saved[f"{name}.buf_gate"] = _copy(c.buf_gate[:n_buf], device)
                if c.overlap and n_entries > 0:
                    saved[f"{name}.ov_kv"] = _copy(c.ov_kv, device)
                    saved[f"{name}.ov_gate"] = _copy(c.ov_gate, device)
            layers[idx] = saved
        logits = None if self.last_logits is None else _copy(self.last_logits, device)
        return Snapshot(pos=self.pos, tokens=list(self.tokens), layers=layers, last_logits=logits)

    def restore(self, snap: "Snapshot") -> None:
        """Make this state equal to the one the snapshot was taken from."""
        if snap.pos > self.max_context:
            raise ValueError(f"snapshot of {snap.pos} tokens does not fit a state of {self.max_context}")
        if set(snap.layers) != set(self.layers):
            raise ValueError(f"snapshot covers layers {sorted(snap.layers)}, state has {sorted(self.layers)}")
        rows = min(snap.pos, self.window)
        for idx, ls in self.layers.items():
            saved = snap.layers[idx]
            ls.window[_ring_slots(snap.pos, rows, self.window)] = saved["window"].to(ls.window.device)
            for name, c in (("compressor", ls.compressor), ("indexer", ls.indexer)):
                if c is None:
                    continue
                n_entries, n_buf = divmod(snap.pos, c.rate)
                c.entries[:n_entries] = saved[f"{name}.entries"].to(c.entries.device)
                c.buf_kv[:n_buf] = saved[f"{name}.buf_kv"].to(c.buf_kv.device)
                c.buf_gate[:n_buf] = saved[f"{name}.buf_gate"].to(c.buf_gate.device)
                if c.overlap and n_entries > 0:
                    c.ov_kv.copy_(saved[f"{name}.ov_kv"])
                    c.ov_gate.copy_(saved[f"{name}.ov_gate"])
        self.pos = snap.pos
        self.tokens = list(snap.tokens)
        self.last_logits = None if snap.last_logits is None else snap.last_logits.clone()

    def fork(self) -> "SequenceState":
        """An independent full copy (same capacity) for prefix sharing."""
        layers = {}
        for idx, ls in self.layers.items():
            layers[idx] = LayerState(
                window=ls.window.clone(),
                compressor=_clone_comp(ls.compressor),
                indexer=_clone_comp(ls.indexer),
            )
        logits = None if self.last_logits is None else self.last_logits.clone()
        return SequenceState(
            layers=layers,
            max_context=self.max_context,
            window=self.window,
            pos=self.pos,
            last_logits=logits,
            tokens=list(self.tokens),
        )


@dataclass
class Snapshot:
    """Committed state sized to what is used: ``pos`` tokens, their ids and the last logits."""

    pos: int
    tokens: list[int]
    layers: dict[int, dict[str, torch.Tensor]]
    last_logits: torch.Tensor | None = None

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for saved in self.layers.values() for t in saved.values())
        if self.last_logits is not None:
            total += self.last_logits.numel() * self.last_logits.element_size()
        return total

    def to(self, device: torch.device | str) -> "Snapshot":
        return Snapshot(
            pos=self.pos,
            tokens=list(self.tokens),
            layers={i: {k: v.to(device) for k, v in saved.items()} for i, saved in self.layers.items()},
            last_logits=None if self.last_logits is None else self.last_logits.to(device),
        )


@dataclass
class CompressorDelta:
    """What a chunk computed for one compressor: rows from the first open window on, and entries."""

    rows_kv: torch.Tensor  # [L, width] raw kv of positions rate*first_entry .. start+S-1
    rows_gate: torch.Tensor  # [L, width] fp32 gate + position bias
    entries: torch.Tensor  # [n_windows, dim] entries of the windows the chunk closes
    first_entry: int


# A one-token static step's entry of the window its token is in: (row [1, dim], slot [1] int64). The step
# does not write it into the entry buffer; the attention and the indexer read the row in that slot's place.
OpenEntry = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LayerDelta:
    window_rows: torch.Tensor  # [S, head_dim] the chunk's K=V rows
    compressor: CompressorDelta | None = None
    indexer: CompressorDelta | None = None


@dataclass
class ChunkDelta:
    """Everything a forward over ``tokens`` at ``start`` would append to the state."""

    start: int
    tokens: list[int]
    layers: dict[int, LayerDelta]

    @property
    def length(self) -> int:
        return len(self.tokens)


def _chunk_form(c: CompressorState, cd: CompressorDelta, pos: int, length: int) -> CompressorDelta:
    """A static block's compressor delta at host position ``pos`` as a chunk's: the open window's
    committed rows before the block's, and the entries of the tokens that close a window. (A one-token
    static delta already holds the open window with its row in its slot, and its one entry.)"""
    buffered = pos % c.rate
    closing = [i for i in range(length) if (pos + i + 1) % c.rate == 0]
    if length == 1:
        rows_kv, rows_gate = cd.rows_kv[: buffered + 1], cd.rows_gate[: buffered + 1]
    elif buffered:
        rows_kv = torch.cat([c.buf_kv[:buffered], cd.rows_kv])
        rows_gate = torch.cat([c.buf_gate[:buffered], cd.rows_gate])
    else:
        rows_kv, rows_gate = cd.rows_kv, cd.rows_gate
    return CompressorDelta(rows_kv, rows_gate, cd.entries[closing], pos // c.rate)


def _commit_compressor(c: CompressorState, cd: CompressorDelta, pos: int, n: int) -> None:
    end = pos + n
    closed = end // c.rate - cd.first_entry  # windows closed within the committed tokens
    if closed > 0:
        c.entries[cd.first_entry : cd.first_entry + closed] = cd.entries[:closed]
        if c.overlap:
            half = c.ov_kv.shape[-1]
            last = slice((closed - 1) * c.rate, closed * c.rate)
            c.ov_kv.copy_(cd.rows_kv[last, :half])
            c.ov_gate.copy_(cd.rows_gate[last, :half])
    keep, start = end % c.rate, closed * c.rate
    c.buf_kv[:keep] = cd.rows_kv[start : start + keep]
    c.buf_gate[:keep] = cd.rows_gate[start : start + keep]


def state_nbytes(cfg: ModelConfig, layers: range, max_context: int, dtype: torch.dtype) -> int:
    """Bytes of one sequence's state of ``max_context`` tokens over ``layers``, counted without allocating
    (the tensors are made on the meta device)."""
    return SequenceState.allocate(cfg, layers, max_context, dtype, "meta").nbytes()


def allocate_layer(
    cfg: ModelConfig, layer_type: str, max_context: int, dtype: torch.dtype, device: torch.device | str
) -> LayerState:
    window = torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device)
    if layer_type == SLIDING:
        return LayerState(window=window)
    rate = cfg.csa_rate if layer_type == CSA else cfg.hca_rate
    capacity = max_context // rate + 1  # + a spare row for the last window's entry (DeviceCommit)
    compressor = CompressorState.allocate(rate, layer_type == CSA, cfg.head_dim, capacity, dtype, device)
    indexer = None
    if layer_type == CSA:
        indexer = CompressorState.allocate(rate, True, cfg.index_head_dim, capacity, dtype, device)
    return LayerState(window=window, compressor=compressor, indexer=indexer)


def _ring_slots(pos: int, rows: int, window: int) -> torch.Tensor:
    return torch.arange(pos - rows, pos) % window


def _copy(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    return t.to(device, copy=True) if device is not None else t.clone()


def _clone_comp(c: CompressorState | None) -> CompressorState | None:
    if c is None:
        return None
    return CompressorState(
        rate=c.rate,
        overlap=c.overlap,
        buf_kv=c.buf_kv.clone(),
        buf_gate=c.buf_gate.clone(),
        ov_kv=None if c.ov_kv is None else c.ov_kv.clone(),
        ov_gate=None if c.ov_gate is None else c.ov_gate.clone(),
        entries=c.entries.clone(),
    )
