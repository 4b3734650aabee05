"""Every released checkpoint format loads: drafts from MXFP4 checkpoints, the stored dtypes, and
checkpoints re-saved by transformers."""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine, SamplingParams
from ds4serve.weights import Checkpoint
from tests.helpers import random_prompt

PROMPT = random_prompt(40, seed=21)


@pytest.mark.parametrize("draft", ["mtp", "dspark"])
def test_drafts_of_an_fp8_mxfp4_checkpoint_are_lossless(tiny_factory, draft):
    path = tiny_factory(seed=8, quantize="fp8+fp4", mtp=1 if draft == "mtp" else 0, dspark=draft == "dspark")
    assert Checkpoint(path).raw("mtp.0.ffn.experts.0.w1.weight").dtype == torch.int8
    engine = Engine.from_pretrained(path)
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=12))
    res = engine.generate(PROMPT, SamplingParams(max_tokens=12), speculative=draft)
    assert res.ok, res.error_message
    assert res.tokens == plain.tokens
    assert res.stats.speculative["method"] == draft and res.stats.speculative["drafted"] > 0
