"""Per-phase GPU profiler and per-request host timing.

Hooks, called from the code they time:

- :func:`phase` around a phase of a forward: ``hc_pre``, ``attention`` (with ``compressor`` and
  ``indexer`` timed as its sub-phases), ``hc_post``, ``moe_ffn``, ``output_projection``.
- :func:`step` around a whole step. ``mode`` is ``prefill`` (one chunk), ``decode`` (one token),
  ``verify`` (speculative verification of q tokens) or ``draft`` (a draft model's forward).
  ``scope`` names the code path honestly: ``forward`` (the default) for the exact layer-range
  forward, a path's own name (for example ``approx_fused_verify``) for anything approximate or
  fused. ``graph=True`` marks the replay of a captured CUDA graph: it is timed as one whole-graph
  record (scope ``<mode>_graph``, e.g. ``decode_graph``) and :func:`phase` records nothing inside
  it, since the graph's phases cannot be seen from the host. Never wrap the capture itself: while
  a stream is capturing, both hooks record nothing.
- :func:`request_timer` per request: with ``DS4SERVE_TIMING`` on, the steps that served it (a batched
  step serves several) make one ``[ds4-timing]`` log line of host wall times and tokens/s per mode when
  it ends, and the same numbers in ``result.stats.host_timing``.

Disabled (``DS4SERVE_GPU_PROFILE`` unset or ``0`` and ``DS4SERVE_TIMING`` off) every hook returns one
shared no-op context manager: no events, no synchronisation, no NVTX, no file, no output.

Enabled, each step emits one record per scope it timed (``phase=step`` for the whole step, then one
per phase that ran), as a log line and as a JSON object with the same fields::

    [ds4-gpu-profile] clock=cuda_event scope=forward mode=decode tokens=1 kv_start=37 layers=0-42 phase=moe_ffn gpu_ms=0.8123 calls=43

``layers`` is the step's layer range (first-last), which tells the shards of a layer split apart.
On a CUDA device (HIP on ROCm builds) the clock is ``cuda_event``: every scope reuses start/stop
event pairs created once, ranges of the same names go to NVTX (ROCTX on ROCm), and the profiler
waits for the device once, when a step ends. Without a GPU the clock is ``host`` (``perf_counter``),
so the feature runs in CI. The profiler's waits and emission happen after the step's host timer
has stopped, and are reported separately as ``profiler_ms``: they never leak into host timing.

CLIs call :func:`configure` at startup; code that never does gets the environment's settings at its
first step. All state that a step touches is per thread.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, Iterator, TextIO

import torch

from . import envs

PHASES = ("hc_pre", "attention", "compressor", "indexer", "hc_post", "moe_ffn", "output_projection")
SUB_PHASES = {"compressor": "attention", "indexer": "attention"}  # timed inside their parent
MODES = ("prefill", "decode", "verify", "draft")
CLOCKS = ("auto", "host", "cuda_event")
STEP = "step"  # the phase name of a whole-step record
RECORD_FIELDS = ("clock", "scope", "mode", "tokens", "kv_start", "layers", "phase", "gpu_ms", "calls")
RECENT_RECORDS = 2048  # records the enabled profiler keeps in memory for recent() (a few hundred steps)

log = logging.getLogger("ds4serve.profiler")
timing_log = logging.getLogger("ds4serve.timing")

_NOOP = nullcontext()
_active: "Profiler | None" = None  # the enabled profiler, or None
_configured = False
_collectors: list[list[dict[str, Any]]] = []


def configure(
    enabled: bool | None = None, file: Path | None = None, *, timing: bool | None = None, clock: str = "auto"
) -> None:
    """Turn the profiler and host timing on or off; ``None`` takes the value from the environment.

    ``enabled``: the GPU phase profiler (``DS4SERVE_GPU_PROFILE``); ``file``: its JSON-lines sink
    (``DS4SERVE_GPU_PROFILE_FILE``); ``timing``: per-request host timing (``DS4SERVE_TIMING``);
    ``clock``: ``auto`` (CUDA events once CUDA is initialised, else host), ``host`` or ``cuda_event``.
    """
    global _active, _configured
    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {list(CLOCKS)}, got {clock!r}")
    gpu = envs.get(envs.GPU_PROFILE) if enabled is None else bool(enabled)
    timed = envs.get(envs.TIMING) if timing is None else bool(timing)
    sink = (envs.get(envs.GPU_PROFILE_FILE) if file is None else Path(file)) if gpu else None
    previous, _active = _active, None
    if previous is not None:
        previous.close()
    if gpu or timed:
        _active = Profiler(gpu=gpu, timing=timed, file=sink, clock=clock)
    _configured = True


def active() -> "Profiler | None":
    """The enabled profiler, or None while profiling and timing are off."""
    return _active


def phase(name: str) -> AbstractContextManager:
    """Scope of one phase inside a forward (``hc_pre``, ``attention``, ``compressor``, ...)."""
    return _NOOP if _active is None else _active.phase(name)


def step(
    mode: str,
    tokens: int,
    kv_start: int,
    layers: range | None,
    *,
    scope: str | None = None,
    graph: bool = False,
) -> AbstractContextManager:
    """Scope of a whole step: a prefill chunk, a decode step, a verify step or a draft forward."""
    if not _configured:
        configure()
    return _NOOP if _active is None else _active.step(mode, tokens, kv_start, layers, scope, graph)


def request_timer(result: Any) -> "RequestTimer | None":
    """A request's host timer, None unless host timing is on: the steps it counts are those run inside its
    :meth:`RequestTimer.active` blocks (a batched step, inside several, counts for each of them);
    :meth:`RequestTimer.finish` fills ``result.stats.host_timing`` and logs it."""
    if not _configured:
        configure()
    return None if _active is None or not _active.timing else RequestTimer(_active, result)


def recent() -> list[dict[str, Any]]:
    """The last :data:`RECENT_RECORDS` records of the enabled GPU profiler, oldest first; [] while it is off."""
    return [] if _active is None else list(_active.recent.copy())


@contextmanager
def collect() -> Iterator[list[dict[str, Any]]]:
    """Also append every record emitted inside the block to the yielded list."""
    records: list[dict[str, Any]] = []
    _collectors.append(records)
    try:
        yield records
    finally:
        _collectors.remove(records)


def format_record(record: dict[str, Any]) -> str:
    """The log line of a record."""
    parts = [f"{k}={record[k]:.4f}" if k == "gpu_ms" else f"{k}={record[k]}" for k in RECORD_FIELDS]
    return "[ds4-gpu-profile] " + " ".join(parts)


# ---- the enabled profiler ----------------------------------------------------------------------
@dataclass
class _OpenScope:
    name: str
    start: Any  # perf_counter() on the host clock, the start event on cuda_event
    stop: Any = None  # the stop event on cuda_event
    device: int = 0  # cuda_event: the device both events belong to


@dataclass
class _Step:
    mode: str
    tokens: int
    kv_start: int
    layers: str
    scope: str
    graph: bool
    depth: int
    clock: str = "host"
    wall_start: float = 0.0
    open: list[_OpenScope] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    host_ms: dict[str, float] = field(default_factory=dict)  # host clock: the totals
    pairs: dict[str, list[tuple[Any, Any]]] = field(default_factory=dict)  # cuda_event: the recorded pairs
    last_stop: dict[int, Any] = field(default_factory=dict)  # cuda_event: device -> its last stop event


@dataclass
class _ModeTotals:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


class _RequestTiming:
    def __init__(self) -> None:
        self.modes: dict[str, _ModeTotals] = {}
        self.profiler_s = 0.0

    def add(self, mode: str, tokens: int, seconds: float) -> None:
        totals = self.modes.setdefault(mode, _ModeTotals())
        totals.steps += 1
        totals.tokens += tokens
        totals.seconds += seconds

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for mode in MODES:
            t = self.modes.get(mode)
            if t is not None:
                out[mode] = {
                    "steps": t.steps,
                    "tokens": t.tokens,
                    "ms": t.seconds * 1e3,
                    "tok_s": t.tokens / t.seconds if t.seconds > 0 else 0.0,
                }
        out["profiler_ms"] = self.profiler_s * 1e3
        return out


class _Thread(threading.local):
    def __init__(self) -> None:
        self.steps: list[_Step] = []
        self.pools: dict[tuple[int, str, int], list[tuple[Any, Any]]] = {}
        self.requests: list[_RequestTiming] = []  # the host timers of the requests the current step serves


class Profiler:
    """The enabled profiler (GPU phases, host timing, or both); see the module docstring."""

    def __init__(self, *, gpu: bool, timing: bool, file: Path | None, clock: str):
        self.gpu = gpu
        self.timing = timing
        self.clock = clock
        self._nvtx = True  # until a push fails
        self._local = _Thread()
        self._sink_lock = threading.Lock()
        self._sink: TextIO | None = None
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_RECORDS)
        if file is not None:
            try:
                self._sink = open(file, "a", buffering=1, encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"DS4SERVE_GPU_PROFILE_FILE: cannot open {file}: {exc}") from exc

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    # ---- scopes --------------------------------------------------------------------------------
    def step(
        self, mode: str, tokens: int, kv_start: int, layers: range | None, scope: str | None, graph: bool
    ) -> AbstractContextManager:
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
        clock = self._clock()
        if clock == "cuda_event" and torch.cuda.is_current_stream_capturing():
            return _NOOP
        shown = "none" if not layers else f"{layers.start}-{layers.stop - 1}"
        name = scope or (f"{mode}_graph" if graph else "forward")
        s = _Step(mode, int(tokens), int(kv_start), shown, name, graph, len(self._local.steps), clock)
        return _StepScope(self, s)

    def phase(self, name: str) -> AbstractContextManager:
        steps = self._local.steps
        if not self.gpu or not steps or steps[-1].graph:
            return _NOOP
        if name not in PHASES:
            log.debug("unknown phase %r ignored", name)
            return _NOOP
        if steps[-1].clock == "cuda_event" and torch.cuda.is_current_stream_capturing():
            return _NOOP
        return _PhaseScope(self, name)

    def begin_phase(self, name: str) -> None:
        """Open ``name`` in the innermost step (no-op outside a step or for an unknown phase)."""
        steps = self._local.steps
        if (
            not self.gpu
            or not steps
            or steps[-1].graph
            or name not in PHASES
            or any(o.name == name for o in steps[-1].open)
        ):
            log.debug(
                "begin_phase(%r) ignored: no phase-timed step open, an unknown phase, or already open", name
            )
            return
        self._begin(steps[-1], name)

    def end_phase(self, name: str) -> None:
        """Close ``name``; a no-op with a debug log unless it is the innermost open phase."""
        steps = self._local.steps
        if not steps or not steps[-1].open or steps[-1].open[-1].name != name or name == STEP:
            log.debug("end_phase(%r) ignored: not the innermost open phase", name)
            return
        self._end(steps[-1])

    # ---- timing --------------------------------------------------------------------------------
    def _clock(self) -> str:
        if self.clock != "auto":
            return self.clock
        return "cuda_event" if torch.cuda.is_available() and torch.cuda.is_initialized() else "host"

    def _begin(self, s: _Step, name: str) -> None:
        if s.clock == "host":
            s.open.append(_OpenScope(name, perf_counter()))
            return
        device = torch.cuda.current_device()
        index = s.calls.get(name, 0)
        pool = self._local.pools.setdefault((s.depth, name, device), [])
        while len(pool) <= index:  # created once per scope and call index, then reused
            pool.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        start, stop = pool[index]
        self._range_push(name if name != STEP else f"{s.mode}:{s.scope}")
        start.record()
        s.open.append(_OpenScope(name, start, stop, device))

    def _end(self, s: _Step) -> None:
        scope = s.open.pop()
        s.calls[scope.name] = s.calls.get(scope.name, 0) + 1
        if s.clock == "host":
            s.host_ms[scope.name] = s.host_ms.get(scope.name, 0.0) + (perf_counter() - scope.start) * 1e3
            return
        scope.stop.record(torch.cuda.current_stream(scope.device))  # the start's device, even if it changed
        self._range_pop()
        s.pairs.setdefault(scope.name, []).append((scope.start, scope.stop))
        s.last_stop[scope.device] = scope.stop

    def _range_push(self, name: str) -> None:
        if self._nvtx:
            try:
                torch.cuda.nvtx.range_push(name)
            except RuntimeError:
                self._nvtx = False

    def _range_pop(self) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()

    def _enter_step(self, s: _Step) -> None:
        if self.timing:
            s.wall_start = perf_counter()
        if self.gpu:
            self._begin(s, STEP)
        self._local.steps.append(s)

    def _exit_step(self, s: _Step, failed: bool) -> None:
        steps = self._local.steps
        if steps and steps[-1] is s:
            steps.pop()
        while s.open:  # phases left open by an exception, then the step itself
            self._end(s)
        reqs = self._local.requests
        if failed:
            return
        if self.timing:
            if s.clock == "cuda_event":
                torch.cuda.synchronize()
            for req in reqs:
                req.add(s.mode, s.tokens, perf_counter() - s.wall_start)
        if self.gpu:
            began = perf_counter()
            self._emit(s)
            for req in reqs:
                req.profiler_s += perf_counter() - began

    # ---- records -------------------------------------------------------------------------------
    def _emit(self, s: _Step) -> None:
        if s.clock == "cuda_event":
            for stop in s.last_stop.values():
                stop.synchronize()  # one wait per device and step, after the host timer stopped
        base = {
            "clock": s.clock,
            "scope": s.scope,
            "mode": s.mode,
            "tokens": s.tokens,
            "kv_start": s.kv_start,
            "layers": s.layers,
        }
        records = []
        for name in (STEP, *PHASES):
            if name not in s.calls:
                continue
            if s.clock == "host":
                ms = s.host_ms[name]
            else:
                ms = sum(start.elapsed_time(stop) for start, stop in s.pairs[name])
            records.append({**base, "phase": name, "gpu_ms": ms, "calls": s.calls[name]})
        self.recent.extend(records)
        for record in records:
            log.info(format_record(record))
            for collected in _collectors:
                collected.append(record)
        if self._sink is not None:
            with self._sink_lock:
                self._sink.write("".join(json.dumps(r) + "\n" for r in records))


class _StepScope:
    def __init__(self, profiler: Profiler, s: _Step):
        self.profiler = profiler
        self.s = s

    def __enter__(self) -> None:
        self.profiler._enter_step(self.s)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.profiler._exit_step(self.s, failed=exc_type is not None)


class _PhaseScope:
    def __init__(self, profiler: Profiler, name: str):
        self.profiler = profiler
        self.name = name

    def __enter__(self) -> None:
        self.profiler.begin_phase(self.name)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.profiler.end_phase(self.name)


class RequestTimer:
    """Host timing of one request (see :func:`request_timer`)."""

    def __init__(self, profiler: Profiler, result: Any):
        self.profiler = profiler
        self.result = result
        self.timing = _RequestTiming()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Count the steps run in this block (on this thread) for the request."""
        reqs = self.profiler._local.requests
        reqs.append(self.timing)
        try:
            yield
        finally:
            reqs.remove(self.timing)

    def finish(self) -> None:
        """Fill ``result.stats.host_timing`` and log the request's line."""
        summary = self.timing.summary()
        self.result.stats.host_timing = summary
        parts = [f"prompt_tokens={self.result.stats.prompt_tokens}", f"generated={len(self.result.tokens)}"]
        for mode in MODES:
            if mode in summary:
                m = summary[mode]
                parts.append(
                    f"{mode}_steps={m['steps']} {mode}_tokens={m['tokens']} {mode}_ms={m['ms']:.3f} "
                    f"{mode}_tok_s={m['tok_s']:.1f}"
                )
        parts.append(f"profiler_ms={summary['profiler_ms']:.3f}")
        timing_log.info("[ds4-timing] " + " ".join(parts))
