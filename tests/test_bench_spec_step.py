"""bench/spec_step.py: a trace's device busy time merges overlapping kernels and copies and leaves host events out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from spec_step import device_busy  # noqa: E402


def _event(cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": cat, "ts": ts, "dur": dur}


def test_overlapping_kernels_count_once_and_host_calls_not_at_all():
    events = [
        _event("kernel", 0, 10),
        _event("kernel", 5, 10),  # overlaps the first (PDL): busy 0..15
        _event("cuda_runtime", 0, 100),
        _event("gpu_memcpy", 30, 5),
        _event("kernel", 34, 6),  # overlaps the copy: busy 30..40
    ]
    assert device_busy({"traceEvents": events}) == (25, 40, [15])


def test_a_trace_without_device_work_is_idle():
    assert device_busy([_event("cpu_op", 0, 100)]) == (0.0, 0.0, [])
