"""Per-sequence inference state: everything a forward reads that earlier tokens wrote.

Per layer:

* the sliding-window ring of K=V rows (``sliding_window`` slots, slot = position mod window);
* for CSA and HCA layers a :class:`CompressorState` (the CSA indexer has a second one): the raw
  projections of the still-open window, the previous closed window's first half (CSA overlap),
  and all compressed entries emitted so far.

All tensors are allocated once for the sequence's maximum context. Counters are derived from the
single committed position ``pos``: a layer with ratio ``m`` has ``pos // m`` entries and
``pos % m`` buffered rows. A forward never writes here; :meth:`SequenceState.commit` applies a
forward's :class:`~ds4serve.model.deepseek4.Pending` for the first ``n`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import kernels
from .config import CSA, SLIDING, ModelConfig

if TYPE_CHECKING:
    from .kernels.commit import CommitPlan


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


@dataclass
class SequenceState:
    """The state of one sequence over a range of layers (a whole model or one shard)."""

    layers: dict[int, LayerState]
    max_context: int
    window: int
    pos: int = 0
    last_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    _commit: "CommitPlan | None" = field(default=None, init=False, repr=False, compare=False)
    _reserved: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def allocate(
        cls, cfg: ModelConfig, layers: range, max_context: int, dtype: torch.dtype, device: torch.device | str
    ) -> "SequenceState":
        out: dict[int, LayerState] = {}
        for layer in layers:
            out[layer] = allocate_layer(cfg, cfg.layer_types[layer], max_context, dtype, device)
        return cls(layers=out, max_context=max_context, window=cfg.sliding_window)

    def part(self, layers: range) -> "SequenceState":
        """The state of ``layers`` only: the same tensors, its own commit plan. A shard's share of a
        layer split's state, for the shard's decode graph (one commit launch per device); its host
        counters are not advanced, the whole state's are."""
        return SequenceState(
            layers={i: self.layers[i] for i in layers},
            max_context=self.max_context,
            window=self.window,
            pos=self.pos,
        )

    def commit(self, delta: "ChunkDelta", n: int) -> None:
        """Append the first ``n`` tokens of a forward's chunk (verify-then-commit)."""
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

    def write_token(self, delta: "ChunkDelta", pos: torch.Tensor) -> None:
        """The device half of committing a static one-token delta at device position ``pos``.

        Reads no host value (it is captured in the decode graph, after the forward); the caller then
        calls :meth:`advance` with the token. Few launches, since each is a node of the graph: the
        open-window rows are copied whole in one multi-tensor copy per dtype (rows past the committed ones are
        the buffer's own), the window's entry is written to its row whether or not this token closes
        it (nothing reads that row before the closing token writes it, and every buffer has a spare
        row for the last, never-closing window), and only the CSA overlap half is conditional.

        With the commit kernel (:mod:`ds4serve.kernels.commit`) the same writes are one launch; a CUDA
        graph that captures this calls :meth:`prepare_capture` before and :meth:`finish_capture` after.
        """
        plan = self._commit_plan(delta)
        if plan is not None:
            plan.launch(pos, self._reserved)
            return
        self._write_token_rows(delta, pos)

    def _write_token_rows(self, delta: "ChunkDelta", pos: torch.Tensor) -> None:
        """:meth:`write_token` through torch writes."""
        slot = pos % self.window
        per_rate: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        copies: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for idx, ld in delta.layers.items():
            ls = self.layers[idx]
            ls.window.index_copy_(0, slot, ld.window_rows)
            for c, cd in ((ls.compressor, ld.compressor), (ls.indexer, ld.indexer)):
                if cd is None:
                    continue
                if c.rate not in per_rate:
                    per_rate[c.rate] = (pos // c.rate, (pos % c.rate == c.rate - 1).view(1, 1))
                row, closing = per_rate[c.rate]
                for dst, src in ((c.buf_kv, cd.rows_kv), (c.buf_gate, cd.rows_gate)):
                    dsts, srcs = copies.setdefault(dst.dtype, ([], []))
                    dsts.append(dst)
                    srcs.append(src)
                c.entries.index_copy_(0, row, cd.entries)
                if c.overlap:
                    half = c.ov_kv.shape[-1]
                    torch.where(closing, cd.rows_kv[:, :half], c.ov_kv, out=c.ov_kv)
                    torch.where(closing, cd.rows_gate[:, :half], c.ov_gate, out=c.ov_gate)
        for dsts, srcs in copies.values():  # one dtype per call: the multi-tensor kernel, not a memcpy each
            torch._foreach_copy_(dsts, srcs)

    def write_block(
        self,
        delta: "ChunkDelta",
        positions: torch.Tensor,
        n: int,
        plans: "list[tuple[CommitPlan, CommitPlan | None]] | None" = None,
    ) -> None:
        """The device half of :meth:`commit_static` of the first ``n`` tokens of a static block whose
        positions are the device tensor ``positions`` (captured once per accepted count in a verify
        graph; the caller then calls :meth:`advance_block`). Token by token, as :meth:`write_token`
        writes: its window row, its compressor rows into their slots of the open window (so a token
        that closes a window finds the whole window there for the CSA overlap) and its entry.
        ``plans`` (:meth:`block_plans`) makes each token two launches of the commit kernel."""
        if _block_width(delta) == 1:  # a one-token static delta has the decode step's form
            if n:
                self._write_token_rows(delta, positions[:1])
            return
        for i in range(n):
            pos = positions[i : i + 1]
            if plans is None:
                self._write_block_row(delta, i, pos)
                continue
            rows, overlap = plans[i]
            rows.launch(pos)
            if overlap is not None:
                overlap.launch(pos)

    def _write_block_row(self, delta: "ChunkDelta", i: int, pos: torch.Tensor) -> None:
        """:meth:`write_block`'s writes of token ``i`` at device position ``pos`` through torch."""
        slot = pos % self.window
        per_rate: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for idx, ld in delta.layers.items():
            ls = self.layers[idx]
            ls.window.index_copy_(0, slot, ld.window_rows[i : i + 1])
            for c, cd in ((ls.compressor, ld.compressor), (ls.indexer, ld.indexer)):
                if cd is None:
                    continue
                if c.rate not in per_rate:
                    per_rate[c.rate] = (pos % c.rate, pos // c.rate, (pos % c.rate == c.rate - 1).view(1, 1))
                row, entry, closing = per_rate[c.rate]
                c.buf_kv.index_copy_(0, row, cd.rows_kv[i : i + 1])
                c.buf_gate.index_copy_(0, row, cd.rows_gate[i : i + 1])
                c.entries.index_copy_(0, entry, cd.entries[i : i + 1])
                if c.overlap:  # after the row: a closing token finds its whole window in the buffer
                    half = c.ov_kv.shape[-1]
                    torch.where(closing, c.buf_kv[:, :half], c.ov_kv, out=c.ov_kv)
                    torch.where(closing, c.buf_gate[:, :half], c.ov_gate, out=c.ov_gate)

    def block_plans(
        self, delta: "ChunkDelta", n: int, positions: torch.Tensor
    ) -> "list[tuple[CommitPlan, CommitPlan | None]] | None":
        """The commit kernel's launches of :meth:`write_block` (two per token), their tables already on
        the device so that a capture can take them; None for the torch code."""
        if not self._commit_kernel_on() or _block_width(delta) == 1:
            return None
        from .kernels.commit import CommitPlan, block_jobs, warm

        plans = []
        for i in range(n):
            rows, overlap = block_jobs(self, delta, i)
            plan, over = CommitPlan.of(rows), CommitPlan.of(overlap)
            if plan is None or (overlap and over is None):
                return None
            for p in (plan, over):
                if p is not None:
                    p.stage(positions.device)
            plans.append((plan, over))
        warm(positions[:1])
        return plans

    def advance_block(self, tokens: list[int]) -> None:
        """The host half of committing the tokens whose rows :meth:`write_block` (or, for one token,
        :meth:`write_token`) wrote."""
        if self.pos + len(tokens) > self.max_context:
            raise ValueError(
                f"committing {len(tokens)} token(s) at {self.pos} exceeds the context of {self.max_context}"
            )
        self.pos += len(tokens)
        self.tokens.extend(tokens)

    def prepare_capture(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Before a CUDA graph captures :meth:`write_token` at ``pos``: load its kernel (a capture
        cannot) and reserve the job table its launch will read; the graph must keep that table."""
        if not self._commit_kernel_on():
            return None
        from .kernels.commit import reserve_table, warm

        warm(pos)
        self._reserved = reserve_table(self, pos.device)
        return self._reserved

    def finish_capture(self) -> None:
        """After a CUDA graph captured :meth:`write_token`: fill the job table that its launch reads
        (the delta's addresses were known only during the capture, which cannot copy from the host)."""
        if self._commit is not None:
            self._commit.upload()

    def _commit_kernel_on(self) -> bool:
        first = next(iter(self.layers.values()), None)
        return first is not None and kernels.enabled(first.window)

    def _commit_plan(self, delta: "ChunkDelta") -> "CommitPlan | None":
        """The commit kernel's plan for ``delta`` (the cached one while the addresses are the same), or
        None for the torch code."""
        if not self._commit_kernel_on():
            return None
        from .kernels.commit import CommitPlan

        plan = CommitPlan.build(self, delta)
        if plan is None or self._commit is None or not plan.same_jobs(self._commit):
            self._commit = plan
        return self._commit

    def advance(self, token: int) -> None:
        """The host half of committing one token whose rows :meth:`write_token` wrote."""
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


def _block_width(delta: "ChunkDelta") -> int:
    return next(iter(delta.layers.values())).window_rows.shape[0]


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


def allocate_layer(
    cfg: ModelConfig, layer_type: str, max_context: int, dtype: torch.dtype, device: torch.device | str
) -> LayerState:
    window = torch.zeros(cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device)
    if layer_type == SLIDING:
        return LayerState(window=window)
    rate = cfg.csa_rate if layer_type == CSA else cfg.hca_rate
    capacity = max_context // rate + 1  # + a spare row for the last window's entry (write_token)
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
