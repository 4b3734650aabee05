"""Static checks that catch what a test run cannot reach: an undefined name in a branch no CPU test takes
(the bench scripts' GPU paths) fails only on the device, after its time is spent. Formatting and import order
are checked here too, with the settings in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TREES = ["ds4serve", "bench", "tests"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--no-cache", *TREES], cwd=ROOT, capture_output=True, text=True
    )


def test_pyflakes_and_import_order_pass_on_the_repository():
    result = _ruff("check", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_is_formatted():
    result = _ruff("format", "--check")
    assert result.returncode == 0, "run `ruff format ds4serve bench tests`\n" + result.stdout + result.stderr
