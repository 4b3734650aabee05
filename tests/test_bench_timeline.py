"""bench/graph_timeline.py's reading of a replay's kernel start times as each kernel's cost to the chain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the benchmark imports the kernels")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from graph_timeline import chain_costs  # noqa: E402


def test_without_pdl_a_kernel_costs_the_time_to_the_next_start():
    assert chain_costs([0.0, 2.0, 12.0, 13.5], pdl=False) == [2.0, 10.0, 1.5, None]


def test_under_pdl_the_next_start_marks_the_end_of_the_kernel_before():
    # kernel 1 (10 us) lets kernel 2 start at once and kernel 3 only when it ends
    starts = [0.0, 1.0, 2.0, 12.0, 13.0]
    assert chain_costs(starts, pdl=True) == [1.0, 10.0, 1.0, None, None]
