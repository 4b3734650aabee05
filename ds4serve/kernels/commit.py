"""The decode graph's commit (:meth:`~ds4serve.state.SequenceState.write_token`) in one launch.

The torch reference writes each state tensor with its own kernel: about 190 per token for the
43-layer model, each a node of the decode graph that costs a launch and a gap. Here every write is a
*job*: copy ``rows`` rows of ``words`` 4-byte words from a source address to a destination whose
first row is ``(pos // div) % mod``, only when ``pos % rate == rate - 1`` (``rate`` 1: always). A table
of jobs, built on the host from the tensors' addresses once per (state, delta) pair, drives one
launch, which reads ``pos`` on the device. Raw words copy every dtype bitwise, so one launch serves
them all; a write that is not whole words leaves the commit to the torch code.

In a CUDA graph the delta's tensors are the ones the captured forward allocates, so their addresses
are known only during the capture, when nothing can be copied from the host: the launch is captured
reading a table that :meth:`CommitPlan.upload` fills once the capture has ended. That table is
allocated before the capture (:func:`reserve_table`): memory allocated during a capture comes from the
graph's pool, where the replay's temporaries of earlier kernels may share its addresses and would
overwrite a table written only once. Nor can a kernel be compiled and loaded during a capture:
:func:`warm` does it before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from . import pdl

if TYPE_CHECKING:
    from ..state import ChunkDelta, SequenceState

WORD = 4  # bytes copied per element of a job
BLOCK = 256  # words per row and load
ROWS_PER_PROGRAM = 8  # rows per load; a job of more rows (an HCA open window: 128) is split over programs
# A job is 9 int64 fields, read by position: src and dst addresses (bytes), words per row, rows,
# src and dst row strides (words), div, mod and rate.
_ROWS = 3
_NOTHING = [0, 0, 0, 0, 0, 0, 1, 1, 1]  # no rows, always
JOB_FIELDS = len(_NOTHING)


@triton.jit
def _commit_kernel(
    jobs_ptr, pos_ptr, FIELDS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.start(PDL)
    job = jobs_ptr + tl.program_id(0).to(tl.int64) * FIELDS
    pos = tl.load(pos_ptr).to(tl.int64)
    rate, rows = tl.load(job + 8), tl.load(job + 3)
    start = tl.program_id(1).to(tl.int64) * ROWS
    if (pos % rate == rate - 1) & (start < rows):
        src = tl.load(job).to(tl.pointer_type(tl.int32))
        dst = tl.load(job + 1).to(tl.pointer_type(tl.int32))
        words = tl.load(job + 2)
        first = (pos // tl.load(job + 6)) % tl.load(job + 7)
        r = start + tl.arange(0, ROWS)
        src_rows = src + r[:, None] * tl.load(job + 4)
        dst_rows = dst + (first + r)[:, None] * tl.load(job + 5)
        row_mask = (r < rows)[:, None]
        for w in range(0, words, BLOCK):
            offs = (w + tl.arange(0, BLOCK))[None, :]
            mask = row_mask & (offs < words)
            tl.store(dst_rows + offs, tl.load(src_rows + offs, mask=mask), mask=mask)


def _launch(jobs: torch.Tensor, pos: torch.Tensor, split: int) -> None:
    _commit_kernel[(jobs.shape[0], split)](
        jobs, pos, FIELDS=JOB_FIELDS, ROWS=ROWS_PER_PROGRAM, BLOCK=BLOCK, num_warps=4, **pdl.launch(pos)
    )


def warm(pos: torch.Tensor) -> None:
    """Compile and load the kernel for ``pos`` (a job that copies nothing): before a CUDA graph
    captures it, since a capture cannot load a module."""
    _launch(torch.tensor([_NOTHING], dtype=torch.int64, device=pos.device), pos, 1)


def reserve_table(state: "SequenceState", device: torch.device) -> torch.Tensor:
    """An unfilled device table for the jobs of ``state``'s ``write_token`` (one per write)."""
    writes = sum(1 + sum(3 + 2 * c.overlap for c in ls.compressors()) for ls in state.layers.values())
    return torch.empty(writes, JOB_FIELDS, dtype=torch.int64, device=device)


def _job(src: torch.Tensor, dst: torch.Tensor, div: int = 1, mod: int = 1, rate: int = 1) -> list[int] | None:
    """Copy ``src``'s rows into ``dst``: the whole tensor (``mod`` 1) or one row at ``(pos // div) % mod``.

    None when it is not a copy of whole words between tensors of one dtype and row length.
    """
    if not _fits(src, dst, mod):
        return None
    rows, width = src.shape
    size = src.element_size()
    row, src_stride, dst_stride = (
        width * size,
        (src.stride(0) if rows > 1 else 0) * size,
        dst.stride(0) * size,
    )
    if any(n % WORD for n in (src.data_ptr(), dst.data_ptr(), row, src_stride, dst_stride)):
        return None
    words, src_stride, dst_stride = row // WORD, src_stride // WORD, dst_stride // WORD
    return [src.data_ptr(), dst.data_ptr(), words, rows, src_stride, dst_stride, div, mod, rate]


def _fits(src: torch.Tensor, dst: torch.Tensor, mod: int) -> bool:
    """Rows of one dtype and length, contiguous within a row; the same shape for a whole copy."""
    if src.dtype != dst.dtype or src.device != dst.device or src.dim() != 2 or dst.dim() != 2:
        return False
    if src.shape[1] != dst.shape[1] or (src.shape[1] > 1 and (src.stride(1) != 1 or dst.stride(1) != 1)):
        return False
    return src.shape == dst.shape if mod == 1 else src.shape[0] == 1 and mod <= dst.shape[0]


def _jobs(state: "SequenceState", delta: "ChunkDelta") -> list[list[int] | None]:
    """The writes of :meth:`~ds4serve.state.SequenceState.write_token`, in its order."""
    jobs = []
    for idx, ld in delta.layers.items():
        ls = state.layers[idx]
        jobs.append(_job(ld.window_rows, ls.window, mod=state.window))
        for c, cd in ((ls.compressor, ld.compressor), (ls.indexer, ld.indexer)):
            if cd is None:
                continue
            jobs.append(_job(cd.entries, c.entries, div=c.rate, mod=c.entries.shape[0]))
            jobs.append(_job(cd.rows_kv, c.buf_kv))
            jobs.append(_job(cd.rows_gate, c.buf_gate))
            if c.overlap:
                half = c.ov_kv.shape[-1]
                jobs.append(_job(cd.rows_kv[:, :half], c.ov_kv, rate=c.rate))
                jobs.append(_job(cd.rows_gate[:, :half], c.ov_gate, rate=c.rate))
    return jobs


def block_jobs(state: "SequenceState", delta: "ChunkDelta", i: int) -> tuple[list, list]:
    """The writes of :meth:`~ds4serve.state.SequenceState.write_block` for token ``i`` of a static
    block: its window row, its compressor rows into their slots of the open window and its entry
    (first launch), then the CSA overlap copied from the open window when the token closes it (second
    launch, which must see the first one's rows)."""
    rows, overlap = [], []
    for idx, ld in delta.layers.items():
        ls = state.layers[idx]
        rows.append(_job(ld.window_rows[i : i + 1], ls.window, mod=state.window))
        for c, cd in ((ls.compressor, ld.compressor), (ls.indexer, ld.indexer)):
            if cd is None:
                continue
            rows.append(_job(cd.entries[i : i + 1], c.entries, div=c.rate, mod=c.entries.shape[0]))
            rows.append(_job(cd.rows_kv[i : i + 1], c.buf_kv, mod=c.rate))
            rows.append(_job(cd.rows_gate[i : i + 1], c.buf_gate, mod=c.rate))
            if c.overlap:
                half = c.ov_kv.shape[-1]
                overlap.append(_job(c.buf_kv[:, :half], c.ov_kv, rate=c.rate))
                overlap.append(_job(c.buf_gate[:, :half], c.ov_gate, rate=c.rate))
    return rows, overlap


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class CommitPlan:
    """The job table of one (state, delta) pair: built on the host, read by the kernel on the device."""

    def __init__(self, table: list[list[int]]):
        self.host = torch.tensor(table, dtype=torch.int64)
        self.split = triton.cdiv(max(job[_ROWS] for job in table), ROWS_PER_PROGRAM)
        self.jobs: torch.Tensor | None = None
        self.staged = False  # the table is on the device before any capture (stage)

    @classmethod
    def build(cls, state: "SequenceState", delta: "ChunkDelta") -> "CommitPlan | None":
        """The plan of ``write_token(delta, pos)`` on ``state``; None if a write is not a copy of words."""
        return cls.of(_jobs(state, delta))

    @classmethod
    def of(cls, table: list[list[int] | None]) -> "CommitPlan | None":
        """The plan of these jobs; None if there are none or one is not a copy of words."""
        if not table or any(job is None for job in table):
            return None
        return cls(table)

    def stage(self, device: torch.device) -> None:
        """Put the table on ``device`` now, for a plan whose tensors exist before a capture of its
        launch (the static block commit: the verify graph's buffers)."""
        self.jobs = torch.empty_like(self.host, device=device)
        self.upload()
        self.staged = True

    def same_jobs(self, other: "CommitPlan") -> bool:
        return torch.equal(self.host, other.host)

    def launch(self, pos: torch.Tensor, reserved: torch.Tensor | None = None) -> None:
        """All the writes at device position ``pos`` (a one-element integer tensor). Under a CUDA graph
        capture the launch reads ``reserved`` (:func:`reserve_table`), filled by :meth:`upload` after."""
        if _capturing(pos) and not self.staged:
            if reserved is None or reserved.shape != self.host.shape:
                raise RuntimeError(
                    "commit kernel: capturing needs the table reserved before the capture "
                    "(SequenceState.prepare_capture)"
                )
            self.jobs = reserved
        elif self.jobs is None:
            self.jobs = torch.empty_like(self.host, device=pos.device)
            self.upload()
        _launch(self.jobs, pos, self.split)

    def upload(self) -> None:
        """Fill the device table; after a capture, whose launch took only its address."""
        self.jobs.copy_(self.host)
