"""The built-in model: a shipped archive (ds4serve/default_model.tar.xz, bench/train_tiny.py's checkpoint) is
unpacked once and served; the shipped one predicts held-out standard-library code as well as was measured when
it was packed."""

from __future__ import annotations

import json
import math
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from stdlib_corpus import heldout_documents  # noqa: E402
from train_tiny import heldout_nll  # noqa: E402

from ds4serve import SamplingParams, cli  # noqa: E402
from ds4serve.engine import Engine  # noqa: E402
from ds4serve.tiny import TinySpec, make_tiny  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402

shipped = pytest.mark.skipif(
    not cli.SHIPPED_MODEL.is_file(),
    reason="no ds4serve/default_model.tar.xz (pack bench/train_tiny.py's output: docs/BENCHMARKS.md)",
)

# train_metrics.json's "shipped" record holds the shipped checkpoint's held-out perplexity measured on the CPU
# with this test's EVAL_TOKENS / EVAL_LEN (on Python 3.11's standard library: another version holds out other
# files); a fifth more fails. (Its "heldout" is the training run's, on the GPU's Python and longer contexts.)
MARGIN = 1.2
EVAL_TOKENS, EVAL_LEN = 4096, 512  # bounded for 2 CPU cores


def _pack(folder: Path, archive: Path) -> None:
    with tarfile.open(archive, "w") as tar:  # uncompressed: xz takes a minute over random weights
        tar.add(folder, arcname=folder.name)


def test_a_shipped_archive_is_unpacked_once_and_served(tmp_path, monkeypatch):
    archive = tmp_path / "default_model.tar"
    _pack(make_tiny(tmp_path / "src" / "my-model", TinySpec(layers=2, mtp=1, fmt="hf")), archive)
    monkeypatch.setattr(cli, "SHIPPED_MODEL", archive)
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = cli.default_model_dir()
    assert folder.name == "my-model" and folder.parent.parent == tmp_path / "cache"
    marker = folder / "seen"
    marker.touch()
    assert cli.default_model_dir() == folder and marker.exists()  # not unpacked again
    assert not (tmp_path / "cache" / "tiny-default-v2").exists()
    assert Engine.from_pretrained(folder).generate([0, 1, 2], SamplingParams(max_tokens=2)).ok

    _pack(make_tiny(tmp_path / "src2" / "my-model", TinySpec(layers=2, seed=1, fmt="hf")), archive)
    assert cli.default_model_dir() != folder  # another archive: unpacked anew


@shipped
def test_heldout_perplexity_is_within_the_recorded_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4SERVE_CACHE_DIR", str(tmp_path))
    folder = cli.default_model_dir()
    metrics = json.loads((folder / "train_metrics.json").read_text())
    rows = metrics["shipped"]["heldout_cpu"]
    recorded = next(r for r in rows if (r["eval_tokens"], r["eval_len"]) == (EVAL_TOKENS, EVAL_LEN))
    bound = MARGIN * recorded["perplexity"]
    engine = Engine.from_pretrained(folder)
    nll, n = heldout_nll(engine, heldout_documents(Tokenizer(folder)), EVAL_TOKENS, EVAL_LEN)
    assert n == EVAL_TOKENS
    assert math.exp(nll) <= bound, (
        f"held-out perplexity {math.exp(nll):.2f} over {n} tokens, bound {bound:.2f}"
    )
