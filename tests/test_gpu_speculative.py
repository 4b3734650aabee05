"""Greedy MTP on the GPU, through the captured verify graphs and draft passes: the drafts that follow each step
into the next verify's block (one captured pass, no host round trip) are the ones the separate observe and
propose passes draft, so the tokens, logprobs and acceptance are bit for bit those of that path."""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine, SamplingParams, cli
from ds4serve.engine.drafts import MTPProposer, resolve_proposer

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not cli.SHIPPED_MODEL.is_file(), reason="no shipped model archive"),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = cli.unpacked(cli.SHIPPED_MODEL, tmp_path_factory.mktemp("shipped"))
    return Engine.from_pretrained(folder, device="cuda:0", dtype="bfloat16", max_batch=1)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_drafts_followed_on_the_device_equal_the_observed_and_proposed_ones(trained, monkeypatch, width):
    prompt = trained.tokenizer.encode("import os\n\n\ndef walk(top, topdown=True):\n    ")
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)

    def run() -> tuple:
        proposer = resolve_proposer(trained, f"mtp:{width}")
        proposer.adaptive = False
        res = trained.generate(prompt, params, speculative=proposer)
        assert res.ok, res.error_message
        return res, proposer

    followed, proposer = run()
    assert proposer.passes is not None and proposer.passes._follows  # the follow pass ran
    monkeypatch.setattr(MTPProposer, "follow", lambda self, committed, k, block: None)
    observed, proposer = run()
    assert followed.tokens == observed.tokens
    assert followed.logprobs == observed.logprobs
    assert followed.stats.speculative == observed.stats.speculative
    assert followed.stats.speculative["accepted"] > 0
