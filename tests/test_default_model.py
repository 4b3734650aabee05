"""The shipped default model (ds4serve/default_model/, written by bench/train_tiny.py) is the trained one and
predicts held-out standard-library code about as well as its training run measured."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from stdlib_corpus import heldout_documents  # noqa: E402
from train_tiny import heldout_nll  # noqa: E402

from ds4serve.cli import SHIPPED_MODEL, default_model_dir  # noqa: E402
from ds4serve.engine import Engine  # noqa: E402
from ds4serve.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (SHIPPED_MODEL / "model.safetensors.index.json").is_file(),
    reason="no shipped checkpoint in ds4serve/default_model/ (bench/train_tiny.py --out writes one)",
)

# The run measured on its own machine's Python (the held-out files differ between versions), over longer
# contexts (--eval-len 2048) and more tokens: allow half as much perplexity again.
MARGIN = 1.5
EVAL_TOKENS, EVAL_LEN = 4096, 512  # bounded for 2 CPU cores


def test_the_default_model_is_the_shipped_checkpoint():
    assert default_model_dir() == SHIPPED_MODEL


def test_heldout_perplexity_is_within_the_recorded_bound():
    metrics = json.loads((SHIPPED_MODEL / "train_metrics.json").read_text())
    bound = MARGIN * metrics["heldout"]["perplexity"]
    engine = Engine.from_pretrained(SHIPPED_MODEL)
    nll, n = heldout_nll(engine, heldout_documents(Tokenizer(SHIPPED_MODEL)), EVAL_TOKENS, EVAL_LEN)
    assert n == EVAL_TOKENS
    assert math.exp(nll) <= bound, (
        f"held-out perplexity {math.exp(nll):.2f} over {n} tokens, bound {bound:.2f}"
    )
