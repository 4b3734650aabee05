"""The device half of committing a static forward's rows: writes addressed by a device position.

A CUDA graph (the decode step, a verify block's accepted prefix, a draft's chained step) cannot read the
host's position, so it commits with writes at a position held in a device tensor, and the host then moves
the counters (:meth:`~ds4serve.state.SequenceState.advance_block`).
The result equals :meth:`~ds4serve.state.SequenceState.commit_static` of the same rows, bit for bit.

Where the kernels run (:func:`ds4serve.kernels.enabled` for the state's tensors) the writes are jobs of the
commit kernel (:mod:`ds4serve.kernels.commit`): a token's writes in one launch (two for a token of a block);
elsewhere, and for a copy that is not whole words, they are the torch writes below, the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import torch

from .. import kernels
from ..state import ChunkDelta, CompressorDelta, CompressorState, LayerDelta, SequenceState

if TYPE_CHECKING:  # the kernel module imports triton: loaded only where the kernels run
    from ..kernels.commit import CommitPlan

BlockPlans = list[tuple["CommitPlan", "CommitPlan | None"]]  # two launches per token of a block


class DeviceCommit:
    """The device writes that commit static deltas to ``state``'s tensors.

    Keeps the commit kernel's plan of the last one-token delta (reused while its addresses are the same) and
    the job table reserved for a CUDA graph's capture of :meth:`write_token`. One per graph that commits.
    """

    def __init__(self, state: SequenceState):
        self.state = state
        self.plan: CommitPlan | None = None  # of the last write_token; None: torch writes
        self._reserved: torch.Tensor | None = None

    def write_token(self, delta: ChunkDelta, pos: torch.Tensor) -> None:
        """Write a static one-token ``delta`` at device position ``pos`` (reads no host value).

        The open-window rows are copied whole (rows past the committed ones are the buffer's own), the
        window's entry is written to its row whether or not this token closes it (nothing reads that row
        before the closing token writes it; every buffer has a spare row for the last window), and only the
        CSA overlap half depends on ``pos``. A graph that captures this calls :meth:`prepare_capture` before
        the capture and :meth:`finish_capture` after it; the caller then calls ``state.advance(token)``.
        """
        plan = self._token_plan(delta)
        if plan is not None:
            plan.launch(pos, self._reserved)
            return
        write_token_rows(self.state, delta, pos)

    def prepare_capture(self, pos: torch.Tensor) -> torch.Tensor | None:
        """Before a CUDA graph captures :meth:`write_token` at ``pos``: load the kernel (a capture cannot)
        and reserve the job table its launch will read; returns it for the graph to keep (None: torch
        writes)."""
        if not _kernel_on(self.state):
            return None
        from ..kernels.commit import reserve_table, warm

        warm(pos)
        self._reserved = reserve_table(_token_writes(self.state), pos.device)
        return self._reserved

    def finish_capture(self) -> None:
        """After a CUDA graph captured :meth:`write_token`: fill the job table its launch reads (the delta's
        addresses were known only during the capture, which cannot copy from the host)."""
        if self.plan is not None:
            self.plan.upload()

    def write_block(
        self, delta: ChunkDelta, positions: torch.Tensor, n: int, plans: BlockPlans | None = None
    ) -> None:
        """Write the first ``n`` tokens of a static block at the device ``positions``, token by token as
        :meth:`write_token` writes: its window row, its compressor rows into their slots of the open window (a
        token that closes a window then finds the whole window there for the CSA overlap) and its entry.
        ``plans`` (:meth:`block_plans`) makes each token two launches of the commit kernel. The caller then
        calls ``state.advance_block(tokens)``."""
        if _block_width(delta) == 1:  # a one-token static delta has the decode step's form
            if n:
                write_token_rows(self.state, delta, positions[:1])
            return
        for i in range(n):
            pos = positions[i : i + 1]
            if plans is None:
                write_block_row(self.state, delta, i, pos)
                continue
            rows, overlap = plans[i]
            rows.launch(pos)
            if overlap is not None:
                overlap.launch(pos)

    def block_plans(self, delta: ChunkDelta, n: int, positions: torch.Tensor) -> BlockPlans | None:
        """The commit kernel's launches of :meth:`write_block` (two per token), their tables already on the
        device so that a capture can take them; None for the torch writes."""
        if not _kernel_on(self.state) or _block_width(delta) == 1:
            return None
        from ..kernels.commit import CommitPlan, warm

        plans = []
        for i in range(n):
            rows, overlap = _block_jobs(self.state, delta, i)
            plan, over = CommitPlan.of(rows), CommitPlan.of(overlap)
            if plan is None or (overlap and over is None):
                return None
            for p in (plan, over):
                if p is not None:
                    p.stage(positions.device)
            plans.append((plan, over))
        # a token's launch takes ``positions[i:i + 1]``: int64 views alternate between 16-byte aligned and
        # not, and Triton compiles one kernel per alignment, so both are loaded before a capture takes them
        for i in range(min(n, 2)):
            warm(positions[i : i + 1])
        return plans

    def _token_plan(self, delta: ChunkDelta) -> CommitPlan | None:
        """The commit kernel's plan of :meth:`write_token` for ``delta`` (the kept one while the addresses
        are the same), or None for the torch writes."""
        if not _kernel_on(self.state):
            return None
        from ..kernels.commit import CommitPlan

        plan = CommitPlan.of(_token_jobs(self.state, delta))
        if plan is None or self.plan is None or not plan.same_jobs(self.plan):
            self.plan = plan
        return self.plan


def _kernel_on(state: SequenceState) -> bool:
    first = next(iter(state.layers.values()), None)
    return first is not None and kernels.enabled(first.window)


def _block_width(delta: ChunkDelta) -> int:
    return next(iter(delta.layers.values())).window_rows.shape[0]


def _layers(
    state: SequenceState, delta: ChunkDelta
) -> Iterator[tuple[int, LayerDelta, list[tuple[CompressorState, CompressorDelta]]]]:
    """``(layer index, layer delta, [(compressor state, its delta)])`` of every layer of ``delta``."""
    for idx, ld in delta.layers.items():
        ls = state.layers[idx]
        pairs = [
            (c, cd) for c, cd in ((ls.compressor, ld.compressor), (ls.indexer, ld.indexer)) if cd is not None
        ]
        yield idx, ld, pairs


def _token_writes(state: SequenceState) -> int:
    """How many jobs :meth:`DeviceCommit.write_token` launches for ``state`` (one per write)."""
    return sum(1 + sum(3 + 2 * c.overlap for c in ls.compressors()) for ls in state.layers.values())


def _overlap_half(c: CompressorState) -> int:
    return c.ov_kv.shape[-1]


def _token_jobs(state: SequenceState, delta: ChunkDelta) -> list[list[int] | None]:
    """The commit kernel's jobs of :func:`write_token_rows`, in its order."""
    from ..kernels.commit import copy_job

    jobs = []
    for idx, ld, pairs in _layers(state, delta):
        jobs.append(copy_job(ld.window_rows, state.layers[idx].window, mod=state.window))
        for c, cd in pairs:
            jobs.append(copy_job(cd.entries, c.entries, div=c.rate, mod=c.entries.shape[0]))
            jobs.append(copy_job(cd.rows_kv, c.buf_kv))
            jobs.append(copy_job(cd.rows_gate, c.buf_gate))
            if c.overlap:
                half = _overlap_half(c)
                jobs.append(copy_job(cd.rows_kv[:, :half], c.ov_kv, rate=c.rate))
                jobs.append(copy_job(cd.rows_gate[:, :half], c.ov_gate, rate=c.rate))
    return jobs


def _block_jobs(state: SequenceState, delta: ChunkDelta, i: int) -> tuple[list, list]:
    """The commit kernel's jobs of :func:`write_block_row` for token ``i``: its window row, its compressor
    rows into their slots of the open window and its entry (first launch), then the CSA overlap copied from
    the open window when the token closes it (second launch, which must see the first one's rows)."""
    from ..kernels.commit import copy_job

    rows, overlap = [], []
    for idx, ld, pairs in _layers(state, delta):
        rows.append(copy_job(ld.window_rows[i : i + 1], state.layers[idx].window, mod=state.window))
        for c, cd in pairs:
            rows.append(copy_job(cd.entries[i : i + 1], c.entries, div=c.rate, mod=c.entries.shape[0]))
            rows.append(copy_job(cd.rows_kv[i : i + 1], c.buf_kv, mod=c.rate))
            rows.append(copy_job(cd.rows_gate[i : i + 1], c.buf_gate, mod=c.rate))
            if c.overlap:
                half = _overlap_half(c)
                overlap.append(copy_job(c.buf_kv[:, :half], c.ov_kv, rate=c.rate))
                overlap.append(copy_job(c.buf_gate[:, :half], c.ov_gate, rate=c.rate))
    return rows, overlap


def write_token_rows(state: SequenceState, delta: ChunkDelta, pos: torch.Tensor) -> None:
    """:meth:`DeviceCommit.write_token` through torch writes: the reference the commit kernel must equal."""
    slot = pos % state.window
    per_rate: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    copies: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for idx, ld, pairs in _layers(state, delta):
        state.layers[idx].window.index_copy_(0, slot, ld.window_rows)
        for c, cd in pairs:
            if c.rate not in per_rate:
                per_rate[c.rate] = (pos // c.rate, (pos % c.rate == c.rate - 1).view(1, 1))
            row, closing = per_rate[c.rate]
            for dst, src in ((c.buf_kv, cd.rows_kv), (c.buf_gate, cd.rows_gate)):
                dsts, srcs = copies.setdefault(dst.dtype, ([], []))
                dsts.append(dst)
                srcs.append(src)
            c.entries.index_copy_(0, row, cd.entries)
            if c.overlap:
                half = _overlap_half(c)
                torch.where(closing, cd.rows_kv[:, :half], c.ov_kv, out=c.ov_kv)
                torch.where(closing, cd.rows_gate[:, :half], c.ov_gate, out=c.ov_gate)
    for dsts, srcs in copies.values():  # one dtype per call: the multi-tensor kernel, not a memcpy each
        torch._foreach_copy_(dsts, srcs)


def write_block_row(state: SequenceState, delta: ChunkDelta, i: int, pos: torch.Tensor) -> None:
    """:meth:`DeviceCommit.write_block`'s writes of token ``i`` at device position ``pos`` through torch: the
    reference the commit kernel must equal."""
    slot = pos % state.window
    per_rate: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for idx, ld, pairs in _layers(state, delta):
        state.layers[idx].window.index_copy_(0, slot, ld.window_rows[i : i + 1])
        for c, cd in pairs:
            if c.rate not in per_rate:
                per_rate[c.rate] = (pos % c.rate, pos // c.rate, (pos % c.rate == c.rate - 1).view(1, 1))
            row, entry, closing = per_rate[c.rate]
            c.buf_kv.index_copy_(0, row, cd.rows_kv[i : i + 1])
            c.buf_gate.index_copy_(0, row, cd.rows_gate[i : i + 1])
            c.entries.index_copy_(0, entry, cd.entries[i : i + 1])
            if c.overlap:  # after the row: a closing token finds its whole window in the buffer
                half = _overlap_half(c)
                torch.where(closing, c.buf_kv[:, :half], c.ov_kv, out=c.ov_kv)
                torch.where(closing, c.buf_gate[:, :half], c.ov_gate, out=c.ov_gate)
