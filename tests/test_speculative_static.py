"""Speculative decoding through static verify blocks (the form the CUDA verify graphs capture) is
lossless: the engine commits the accepted prefix with ``commit_static`` and the tokens equal plain
decoding. On CPU the "graph" runs the static block eagerly; capturing it is checked on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from ds4serve import SamplingParams
from tests.helpers import random_prompt
from tests.test_speculative import MAX_TOKENS, PROMPT, _oracle, dspark_engine, mtp_engine  # noqa: F401

MTP_PROMPT = random_prompt(40, seed=12)


class EagerStaticBlock:
    """:class:`~ds4serve.engine.cuda_graphs.VerifyGraph`'s interface, the static forward run eagerly."""

    def __init__(self, model, state, width: int, capture: tuple[int, ...]):
        self.model, self.state, self.width, self.capture = model, state, width, capture
        self.runs = 0

    def run(self, block: list[int]):
        assert len(block) == self.width
        self.runs += 1
        positions = torch.arange(self.state.pos, self.state.pos + self.width)
        return self.model.forward(torch.tensor(block), self.state, logit_rows=slice(None), capture=self.capture,
                                  positions=positions)


def _static_blocks(engine, monkeypatch) -> dict:
    made: dict = {}

    def graph(model, state, width, capture):
        return made.setdefault((width, tuple(capture)), EagerStaticBlock(model, state, width, tuple(capture)))

    monkeypatch.setattr(engine, "_verify_graph", graph)
    return made


@pytest.fixture(scope="module")
def plain(engine):
    return engine.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("width,p", [(2, 0.5), (3, 0.9), (4, 0.5), (6, 0.9), (6, 1.0)])
def test_static_verify_blocks_equal_plain_decoding(engine, plain, monkeypatch, width, p):
    made = _static_blocks(engine, monkeypatch)
    res = engine.generate(PROMPT, SamplingParams(max_tokens=MAX_TOKENS), speculative=_oracle(PROMPT, plain, p, width))
    assert res.ok, res.error_message
    assert res.tokens == plain.tokens
    spec = res.stats.speculative
    assert sum(g.runs for g in made.values()) == spec["steps"]  # every verify step ran as a static block
    assert set(spec["verify_widths"]) == {w for w, _ in made}


@pytest.mark.parametrize("which,spec", [("mtp", "mtp"), ("dspark", "dspark")])
def test_drafts_through_static_verify_blocks_are_lossless(request, monkeypatch, which, spec):
    """MTP reads the final streams of the static block's accepted rows, DSpark its captured layers."""
    engine = request.getfixturevalue(f"{which}_engine")
    ref = engine.generate(MTP_PROMPT, SamplingParams(max_tokens=12))
    made = _static_blocks(engine, monkeypatch)
    res = engine.generate(MTP_PROMPT, SamplingParams(max_tokens=12), speculative=spec)
    assert res.ok, res.error_message
    assert res.tokens == ref.tokens
    assert made and res.stats.speculative["drafted"] > 0
    if which == "dspark":
        assert all(capture for _, capture in made)  # the target's feature layers came from the block
