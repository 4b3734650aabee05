"""Static checks that catch what a test run cannot reach: an undefined name in a branch no CPU test takes
(the bench scripts' GPU paths) fails only on the device, after its time is spent."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_pyflakes_rules_pass_on_the_repository():
    pytest.importorskip("ruff")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--select",
            "F",
            "--no-cache",
            "--output-format",
            "concise",
            "ds4serve",
            "bench",
            "tests",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
