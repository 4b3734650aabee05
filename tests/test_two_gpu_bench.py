"""bench/two_gpu.py end to end on the CPU: the in-process split and the 2-rank gloo pipeline of the
same tiny random shards, and the greedy comparison between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_two_gpu_bench_cpu_smoke(tmp_path):
    out = tmp_path / "two_gpu.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "two_gpu.py"),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--dims",
        "tiny",
        "--layers",
        "4",
        "--experts",
        "8",
        "--contexts",
        "24,80",
        "--chunk",
        "32",
        "--steps",
        "3",
        "--reps",
        "3",
        "--greedy-tokens",
        "6",
        "--spec-widths",
        "2,4",
        "--accept",
        "0.5",
        "--spec-prompt",
        "16",
        "--spec-tokens",
        "8",
        "--mtp",
        "2",
        "--timeout-s",
        "60",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["greedy_identical"] is True
    for placement in ("split", "pipeline"):
        s = r[placement]
        assert s["placement"] == placement and len(s["greedy"]["tokens"]) == 6
        assert [sh["layers"] for sh in s["shards"]] == [[0, 1], [2, 3]]
        assert s["boundary"]["decode_ms"] > 0 and s["bytes_per_token_GB"] > 0
        assert all(s[f"ctx_{c}"]["same_tokens_after_restore"] for c in (24, 80))
        assert s["prefill"]["context"] == 80 and s["prefill"]["tokens_per_s_after_first_chunk"] > 0
        runs = s["speculative"]["runs"]
        assert [(x["width"], x["p"]) for x in runs] == [(2, 0.5), (4, 0.5)]
        assert all(x["equal_to_plain"] for x in runs)
    assert r["split"]["shards"] == r["pipeline"]["shards"]
    mtp = r["split"]["speculative"]["mtp"]  # random MTP drafts on the split, passes eager then static
    assert [x["draft_passes"] for x in mtp] == ["eager", "graphs"] and all(x["tokens_per_s"] > 0 for x in mtp)
    assert "mtp" not in r["pipeline"]["speculative"]
