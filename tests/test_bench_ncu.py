"""bench/ncu_decode.py: Nsight Compute's raw CSV read into kernels (units, stall reasons) and grouped by layer."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from ncu_decode import _layers, parse  # noqa: E402

_HEADER = [
    "ID",
    "Kernel Name",
    "gpu__time_duration.sum",
    "dram__bytes.sum.per_second",
    "launch__grid_size",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
    "smsp__pcsamp_warps_issue_stalled_wait_per_warp_active.ratio",
]
_UNITS = ["", "", "us", "Tbyte/s", "", "inst", "inst", ""]


def _csv(tmp_path: Path, rows: list[tuple[str, str, str, str]]) -> Path:
    out = io.StringIO()
    out.write("==PROF== Connected to process 1\n")
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    writer.writerow(_HEADER)
    writer.writerow(_UNITS)
    for i, (name, duration, rate, stall) in enumerate(rows):
        writer.writerow([i, name, duration, rate, "1,024", stall, "0.5", "99"])
    path = tmp_path / "raw.csv"
    path.write_text(out.getvalue())
    return path


def test_values_in_common_units_and_stalls_ranked(tmp_path):
    path = _csv(tmp_path, [("_gemv_dot_kernel", "10.0", "3.5", "4.0")])
    path.write_text(
        path.read_text()
        .replace('"us","Tbyte/s"', '"nsecond","Gbyte/s"')
        .replace('"10.0","3.5"', '"10,000","3,500"')
    )
    (k,) = parse(path)
    assert k.values["us"] == 10.0 and k.values["DRAM_TB/s"] == 3.5 and k.values["grid"] == 1024
    assert k.dram_mb == 35.0 and k.streams_weights
    # the per-issue form of a reason wins over another form of the same reason
    assert k.stalls == [(4.0, "long_scoreboard"), (0.5, "wait")]


def test_layers_run_from_one_attention_site_to_the_next_and_the_head_follows_the_last_moe(tmp_path):
    layer = [
        ("_hc_pre_kernel", "9", "0.1", "1"),
        ("_gemv_dot_kernel", "10", "3", "1"),
        ("_hc_pre_kernel", "9", "0.1", "1"),
        ("_gate_up_kernel", "30", "3.6", "1"),
        ("_down_kernel", "20", "3.2", "1"),
    ]
    kernels = parse(_csv(tmp_path, layer + layer + [("_gemv_dot_kernel", "235", "4.5", "1")]))
    groups = _layers(kernels)
    assert [label for label, _ in groups] == ["layer 0", "layer 1", "head"]
    assert [len(g) for _, g in groups] == [5, 5, 1]
    assert sum(k.values["us"] for k in groups[0][1] if k.streams_weights) == 60.0
