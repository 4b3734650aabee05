"""L2 prefetch of the weights a captured decode step reads next, on a side branch of the CUDA graph.

In a batch-1 decode step HBM idles while latency-bound launches run (an mHC site ~9 us, the norms, RoPE and
decode attention after ``q_res`` ~18 us), and the projection after such a window starts cold. A 33.5 MB FP8
GEMV took 11.6-14.1 us cold and 7.9-8.9 us when its weight had been requested into L2 by another kernel
during a 12 us idle window before it (H200, ``bench/probe_l2.py`` of commit 0cb3e51; bench/RESULTS.md,
thirteenth run). Two earlier ways of issuing those requests lost time: extra programs of the window's own
launches (the next kernel then waited for the whole grid, requests included) and requests before a launch's
PDL wait.

Here the requests come from a separate launch on a *side stream* forked from the capturing stream: in the
graph it is a branch that starts when the kernel before the fork point has finished and that nothing on the
main chain waits for, until :func:`join` at the end of the capture. The main chain's kernels and their PDL
edges are the same as without it, and nothing reads what the requests bring in, so every result is unchanged.

A fork is triggered by the tensor an op reads (:func:`before` / :func:`after`, called by :mod:`ops` with the
tensor that identifies the launch: an mHC site's ``fn``, a projection's weight). A model registers, once
before its capture, which *plan* each trigger forks (:func:`register`; ``model/prefetch_plans.py`` chooses
the weights): an int64 tensor ``[n, 2]`` of ``(address, bytes)`` pieces. Forks happen only while a CUDA
stream is being captured; eager steps never prefetch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
import triton
import triton.language as tl

from .switches import SWITCHES, prefetching

PIECE_BYTES = 1 << 20
BUDGET_BYTES = 40 << 20  # per window: below the H200's 50 MB L2, as the probe's best budgets (32-40 MB)
PROGRAMS = 16
_LINE = tl.constexpr(128)  # bytes of an L2 line request
_LANES = tl.constexpr(256)  # lines one loop step requests: one per thread of an 8-warp program


def plan(weights: Iterable[torch.Tensor], budget: int = BUDGET_BYTES, piece: int = PIECE_BYTES) -> torch.Tensor:
    """The ``(address, bytes)`` pieces ``[n, 2]`` (int64, on the weights' device) of ``weights``' storage,
    in order, until ``budget`` bytes; each piece at most ``piece`` bytes. Tensors must be contiguous."""
    rows: list[tuple[int, int]] = []
    device = None
    left = budget
    for t in weights:
        if not t.is_contiguous():
            raise ValueError("prefetch.plan: weights must be contiguous (a piece is one address range)")
        device = t.device
        n = min(t.numel() * t.element_size(), left)
        rows.extend((t.data_ptr() + off, min(piece, n - off)) for off in range(0, n, piece))
        left -= n
        if left <= 0:
            break
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 2)


@dataclass(frozen=True)
class Trigger:
    """A registered fork: ``window`` names the switch that enables it (``prefetch_<window>``); the plan is
    forked only while the tensor that triggers it is alive (its weakref)."""
    window: str
    pieces: torch.Tensor
    alive: weakref.ref


_before: dict[tuple[int, int], Trigger] = {}
_after: dict[tuple[int, int], Trigger] = {}
_streams: dict[int, torch.cuda.Stream] = {}  # device index -> its side stream
_forked: set[int] = set()  # devices whose side stream has work not yet joined


def _key(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def register(trigger: torch.Tensor, window: str, pieces: torch.Tensor, *, after: bool) -> None:
    """Fork ``pieces`` when an op launches on ``trigger`` (before its launch, or ``after`` it) while a
    capture runs and ``SWITCHES.prefetch_<window>`` is on."""
    if not hasattr(SWITCHES, f"prefetch_{window}"):
        raise ValueError(f"prefetch.register: no switch prefetch_{window}")
    (_after if after else _before)[_key(trigger)] = Trigger(window, pieces, weakref.ref(trigger))


def registered(trigger: torch.Tensor, *, after: bool) -> Trigger | None:
    """The live fork registered on ``trigger``, if any."""
    found = (_after if after else _before).get(_key(trigger))
    return found if found is not None and found.alive() is not None else None


def before(trigger: torch.Tensor) -> None:
    """Called by an op just before it launches on ``trigger``."""
    _fork(trigger, after=False)


def after(trigger: torch.Tensor) -> None:
    """Called by an op just after it launched on ``trigger``."""
    _fork(trigger, after=True)


def capturing(t: torch.Tensor) -> bool:
    """Whether the current stream of ``t``'s device is being captured (the only time a fork happens)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _fork(trigger: torch.Tensor, *, after: bool) -> None:
    if not (_before or _after) or not capturing(trigger):
        return
    found = registered(trigger, after=after)
    if found is None or not getattr(SWITCHES, f"prefetch_{found.window}"):
        return
    launch_branch(found.pieces)


def launch_branch(pieces: torch.Tensor) -> None:
    """Request ``pieces`` into L2 from a launch on the device's side stream, forked from the current stream
    (the branch waits for what the current stream has launched so far; :func:`join` ends it)."""
    main = torch.cuda.current_stream(pieces.device)
    side = _side_stream(pieces.device, main)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        _launch(pieces)
    _forked.add(_index(pieces.device))


def _launch(pieces: torch.Tensor) -> None:
    _prefetch_kernel[(PROGRAMS,)](pieces, pieces.shape[0], EVICT_LAST=SWITCHES.prefetch_evict_last, num_warps=8)


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(device: torch.device, main: torch.cuda.Stream) -> torch.cuda.Stream:
    """The device's side stream: one from torch's pool, kept, and never the stream being captured (the pool
    hands out its streams in turn, so a capture stream may be any of them)."""
    i = _index(device)
    side = _streams.get(i)
    while side is None or side == main:
        side = _streams[i] = torch.cuda.Stream(device)
    return side


def warm(device: torch.device) -> None:
    """Before a capture: take the device's side stream and compile and load the prefetch kernel (a launch
    with no pieces), so that the capture does neither; only when a prefetch switch is on."""
    if device.type != "cuda" or not prefetching():
        return
    _side_stream(device, torch.cuda.current_stream(device))
    _launch(torch.zeros(0, 2, dtype=torch.int64, device=device))


def join(device: torch.device) -> None:
    """Make the current stream of ``device`` wait for the side branch forked since the last join (the end
    of a capture: a captured graph must join every stream it forked)."""
    i = _index(device)
    if i in _forked:
        _forked.discard(i)
        torch.cuda.current_stream(device).wait_stream(_streams[i])


def discard(device: torch.device) -> None:
    """Forget a fork whose capture failed (nothing to join any more)."""
    if device.type == "cuda":
        _forked.discard(_index(device))


@triton.jit(do_not_specialize=["n_pieces"])
def _prefetch_kernel(pieces_ptr, n_pieces, EVICT_LAST: tl.constexpr):
    """Program ``p`` of the grid requests every 128-byte L2 line of pieces ``p, p + grid, ...``."""
    prog = tl.program_id(0)
    n_programs = tl.num_programs(0)
    lanes = tl.arange(0, _LANES) * _LINE
    for i in range(prog, n_pieces, n_programs):
        addr = tl.load(pieces_ptr + 2 * i)
        n = tl.load(pieces_ptr + 2 * i + 1)
        for off in range(0, n, _LANES * _LINE):
            lines = (addr + tl.minimum(off + lanes, n - 1)).to(tl.pointer_type(tl.int8))
            if EVICT_LAST:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [lines],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [lines],
                                          dtype=tl.int32, is_pure=False, pack=1)
