"""The full forward equals transformers' DeepseekV4ForCausalLM (no cache) on the same weights."""

from __future__ import annotations

import pytest
import torch

from ds4serve import Engine
from ds4serve.config import CSA, HCA
from tests.helpers import random_prompt

transformers = pytest.importorskip("transformers")

# (TinySpec fields, prompt length): several seeds and shapes; 260-token prompts close many HCA
# windows (ratio 16) and give 65 CSA entries against index_topk 8, so the indexer is selective.
CASES = [
    (dict(seed=0), 260),
    (dict(seed=1, layers=5, experts=6, top_k=2), 260),
    (dict(seed=2, window=8, hca_rate=8, index_topk=5), 150),
    (dict(seed=3, layers=4, hca_rate=32, index_topk=12), 260),
]


def _hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("fields,length", CASES, ids=[f"seed{c[0]['seed']}" for c in CASES])
def test_full_forward_matches_transformers(tiny_factory, fields, length):
    hf_dir = tiny_factory(fmt="hf", **fields)
    engine = Engine.from_pretrained(hf_dir)
    cfg = engine.cfg
    assert CSA in cfg.layer_types and HCA in cfg.layer_types
    assert length // cfg.csa_rate > cfg.index_topk, "the indexer must be selective"
    assert length // cfg.hca_rate >= 4, "several HCA windows must close"
    ids = random_prompt(length, seed=100 + fields["seed"])
    ours = engine.score(ids)
    ref = _hf_logits(hf_dir, ids)
    assert ours.shape == ref.shape == (length, cfg.vocab_size)
    err = (ours - ref).abs().max() / ref.abs().max()
    assert err <= 1e-4, f"max |Δ| / max|logit| = {err:.3g}"


def test_official_layout_gives_identical_logits(tiny_factory):
    ids = random_prompt(90, seed=7)
    hf = Engine.from_pretrained(tiny_factory(fmt="hf", seed=0)).score(ids)
    official = Engine.from_pretrained(tiny_factory(fmt="official", seed=0)).score(ids)
    assert torch.equal(hf, official)


def test_indexer_selection_changes_the_output(tiny_factory):
    """Guard against a vacuous oracle: a larger index_topk must change the late logits."""
    ids = random_prompt(200, seed=9)
    selective = Engine.from_pretrained(tiny_factory(seed=0)).score(ids)
    everything = Engine.from_pretrained(tiny_factory(seed=0, index_topk=1000)).score(ids)
    early = 4 * 8  # positions whose queries see at most index_topk entries agree
    assert torch.allclose(selective[:early], everything[:early], atol=1e-5)
    assert not torch.allclose(selective[-20:], everything[-20:], atol=1e-3)
