"""bench/spec_step.py: a trace's device busy time merges overlapping kernels and copies and leaves host events out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from spec_step import device_busy, launch_table, launches  # noqa: E402


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


def _launched(cat: str, name: str, ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_kernels_group_by_the_graph_replay_or_launch_that_issued_them():
    events = [
        _launched("cuda_runtime", "cudaGraphLaunch", 0, 5, 1),
        _launched("kernel", "gemv", 10, 4, 1),
        _launched("kernel", "norm", 15, 2, 1),
        _launched("cuda_runtime", "cudaGraphLaunch", 20, 5, 2),
        _launched("kernel", "gemv", 30, 6, 2),
        _launched("kernel", "norm", 37, 2, 2),
        _launched("cuda_runtime", "cudaLaunchKernel", 40, 5, 3),
        _launched("kernel", "argmax", 50, 1, 3),
    ]
    groups = launches({"traceEvents": events})
    assert groups == {
        ("cudaGraphLaunch", 1): [("gemv", 4), ("norm", 2)],
        ("cudaGraphLaunch", 2): [("gemv", 6), ("norm", 2)],
        ("cudaLaunchKernel", 3): [("argmax", 1)],
    }
    lines = launch_table(events)
    assert lines[0] == "graph of 2 kernels x 2 replays: median 8.0 us of kernels"
    assert lines[1].split() == ["6.0", "us", "x", "1", "gemv"]
    assert lines[3] == "outside graphs: 1 kernels, 1.0 us"
