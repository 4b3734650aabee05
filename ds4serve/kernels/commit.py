"""Row copies at a device position in one launch: the device half of committing a static delta.

A *job* copies ``rows`` rows of ``words`` 4-byte words from a source address to a destination whose first
row is ``(pos // div) % mod``, only when ``pos % rate == rate - 1`` (``rate`` 1: always). A table of jobs,
built on the host from the tensors' addresses (:func:`copy_job`), drives one launch that reads ``pos`` on the
device. Raw words copy every dtype bitwise, so one launch serves them all; :func:`copy_job` returns None for a
copy that is not whole words, and the caller then writes with torch. Which copies make a commit is the
caller's business (:mod:`ds4serve.engine.device_commit`); this module knows tensors only.

Under a CUDA graph capture nothing can be copied from the host and no kernel can be loaded: a launch
captured before its tensors existed reads a table reserved before the capture (:func:`reserve_table`,
not from the graph's pool, whose addresses the replay's temporaries may share) and filled after it
(:meth:`CommitPlan.upload`); :func:`warm` loads the kernel beforehand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl

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


def reserve_table(jobs: int, device: torch.device) -> torch.Tensor:
    """An unfilled device table for ``jobs`` jobs, for a launch that a CUDA graph captures."""
    return torch.empty(jobs, JOB_FIELDS, dtype=torch.int64, device=device)


def copy_job(
    src: torch.Tensor, dst: torch.Tensor, div: int = 1, mod: int = 1, rate: int = 1
) -> list[int] | None:
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


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class CommitPlan:
    """A table of jobs: built on the host, read by the kernel on the device, launched as one."""

    def __init__(self, table: list[list[int]]):
        self.host = torch.tensor(table, dtype=torch.int64)
        self.split = triton.cdiv(max(entry[_ROWS] for entry in table), ROWS_PER_PROGRAM)
        self.jobs: torch.Tensor | None = None
        self.staged = False  # the table is on the device before any capture (stage)

    @classmethod
    def of(cls, table: list[list[int] | None]) -> "CommitPlan | None":
        """The plan of these jobs; None if there are none or one is not a copy of words."""
        if not table or any(entry is None for entry in table):
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
                    "commit kernel: capturing needs the table reserved before the capture (reserve_table)"
                )
            self.jobs = reserved
        elif self.jobs is None:
            self.jobs = torch.empty_like(self.host, device=pos.device)
            self.upload()
        _launch(self.jobs, pos, self.split)

    def upload(self) -> None:
        """Fill the device table; after a capture, whose launch took only its address."""
        self.jobs.copy_(self.host)
