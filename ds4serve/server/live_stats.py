"""Recent-window figures of one server, for the page's engine view (``GET /v1/engine/stats``).

The scheduler reports each token and each decode step here as it happens (on the engine's thread); a reader
(the event loop) asks for a summary of the last seconds. Rates (tokens/s, decode steps) cover the last
``rate_window_s`` seconds, latency percentiles (time to first token, inter-token) the last
``latency_window_s``. Prometheus' histograms (metrics.py) keep every observation since start, which says
nothing about the last minute; this module keeps only the window, so its memory is bounded by the traffic of
that window.

Also here: the process' memory and the grouping of the GPU profiler's recent records into steps.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from typing import Any, Callable

import torch

PROFILED_PHASES = ("hc_pre", "attention", "moe_ffn", "hc_post", "output_projection")  # a step's top level
PROFILED_STEPS = 40  # the recent steps /v1/engine/stats lists one by one


class LiveStats:
    """Counts of the last seconds; every method is thread-safe.

    ``clock`` (seconds, monotonic) is injectable so tests can move time by hand."""

    def __init__(
        self,
        rate_window_s: float = 10.0,
        latency_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if rate_window_s <= 0 or latency_window_s <= 0:
            raise ValueError("the windows must be positive")
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self.clock = clock
        self.started = clock()
        self.prompt_tokens = 0  # prompts prefilled, since start (cached tokens not included)
        self.generated_tokens = 0  # tokens generated, since start, running requests included
        self._lock = threading.Lock()
        self._prefilled: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)
        self._tokens: collections.deque[float] = collections.deque()  # time of each generated token
        self._steps: collections.deque[tuple[float, int]] = collections.deque()  # (time, decode rows)
        self._ttft: collections.deque[tuple[float, float]] = collections.deque()  # (time, seconds)
        self._gaps: collections.deque[tuple[float, float]] = collections.deque()  # (time, seconds)
        self._last_batch = 0

    def first_token(self, ttft_s: float, prefilled: int) -> None:
        """A request's first token, ``ttft_s`` after it was submitted, its ``prefilled`` prompt tokens done."""
        now = self.clock()
        with self._lock:
            self.prompt_tokens += prefilled
            self.generated_tokens += 1
            self._prefilled.append((now, prefilled))
            self._tokens.append(now)
            self._ttft.append((now, ttft_s))
            self._trim(now)

    def next_token(self, gap_s: float) -> None:
        """A later token of a request, ``gap_s`` after the one before it."""
        now = self.clock()
        with self._lock:
            self.generated_tokens += 1
            self._tokens.append(now)
            self._gaps.append((now, gap_s))
            self._trim(now)

    def decode_step(self, rows: int) -> None:
        """A decode forward over ``rows`` sequences."""
        now = self.clock()
        with self._lock:
            self._last_batch = rows
            self._steps.append((now, rows))
            self._trim(now)

    def summary(self) -> dict[str, Any]:
        """Rates over the rate window (over the time since start while that is shorter), percentiles over the
        latency window, in milliseconds; a percentile of no sample is None."""
        now = self.clock()
        with self._lock:
            self._trim(now)
            span = max(min(self.rate_window_s, now - self.started), 1e-3)
            rows = [r for _, r in self._steps]
            return {
                "uptime_s": now - self.started,
                "window_s": {"rates": self.rate_window_s, "latency": self.latency_window_s},
                "tokens_per_s": {
                    "prompt": sum(n for _, n in self._prefilled) / span,
                    "generated": len(self._tokens) / span,
                },
                "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
                "decode_steps": {
                    "per_s": len(rows) / span,
                    "mean_batch": sum(rows) / len(rows) if rows else 0.0,
                    "max_batch": max(rows, default=0),
                    "last_batch": self._last_batch,
                },
                "ttft_ms": _percentiles([s for _, s in self._ttft]),
                "inter_token_ms": _percentiles([s for _, s in self._gaps]),
            }

    def _trim(self, now: float) -> None:
        rate_edge, latency_edge = now - self.rate_window_s, now - self.latency_window_s
        for events in (self._prefilled, self._steps):
            while events and events[0][0] < rate_edge:
                events.popleft()
        while self._tokens and self._tokens[0] < rate_edge:
            self._tokens.popleft()
        for events in (self._ttft, self._gaps):
            while events and events[0][0] < latency_edge:
                events.popleft()


def _percentiles(seconds: list[float]) -> dict[str, Any]:
    """p50 and p99 (nearest rank) of ``seconds`` in milliseconds, and the count."""
    ordered = sorted(seconds)

    def rank(q: float) -> float | None:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3 if ordered else None

    return {"p50": rank(0.50), "p99": rank(0.99), "count": len(ordered)}


def process_memory() -> dict[str, Any]:
    """The process' resident memory (None where ``/proc`` does not say) and, once CUDA is in use, each
    device's memory held by torch and its total."""
    rss = None
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    cuda = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for d in range(torch.cuda.device_count()):
            cuda.append(
                {
                    "device": f"cuda:{d}",
                    "allocated_bytes": torch.cuda.memory_allocated(d),
                    "reserved_bytes": torch.cuda.memory_reserved(d),
                    "total_bytes": torch.cuda.get_device_properties(d).total_memory,
                }
            )
    return {"rss_bytes": rss, "cuda": cuda}


def profiled_steps(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPU profiler's records (``profiler.recent()``, oldest first) grouped into steps.

    Returns ``modes``: per mode, the steps seen and the mean milliseconds of the whole step and of each phase
    (a phase that did not run in a step counts 0 for it); and ``recent``: the last :data:`PROFILED_STEPS`
    steps, each ``{"mode", "scope", "tokens", "step_ms", "phases": {name: ms}}``. A step replayed as a CUDA
    graph has no phases."""
    steps: list[dict[str, Any]] = []
    for r in records:
        if r["phase"] == "step":
            steps.append(
                {
                    "mode": r["mode"],
                    "scope": r["scope"],
                    "tokens": r["tokens"],
                    "step_ms": r["gpu_ms"],
                    "phases": {},
                }
            )
        elif steps and steps[-1]["mode"] == r["mode"]:  # a phase belongs to the step record before it
            steps[-1]["phases"][r["phase"]] = r["gpu_ms"]
    modes: dict[str, dict[str, Any]] = {}
    for s in steps:
        m = modes.setdefault(s["mode"], {"steps": 0, "step_ms": 0.0, "phases": {}})
        m["steps"] += 1
        m["step_ms"] += s["step_ms"]
        for name, ms in s["phases"].items():
            m["phases"][name] = m["phases"].get(name, 0.0) + ms
    for m in modes.values():
        m["step_ms"] /= m["steps"]
        m["phases"] = {name: ms / m["steps"] for name, ms in m["phases"].items()}
    return {"modes": modes, "recent": steps[-PROFILED_STEPS:]}
