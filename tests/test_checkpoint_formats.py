"""Every released checkpoint format loads: drafts from MXFP4 checkpoints, the stored dtypes, and
checkpoints re-saved by transformers."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ds4serve import Engine, SamplingParams
from ds4serve.quant import e8m0_to_float, float_to_e8m0
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


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", text).group(0).split("."))


def test_the_safetensors_floor_opens_e8m0_scales(tmp_path):
    """Every released shard holds F8_E8M0 block scales; safetensors opens them from 0.6.2 on."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"safetensors>=([\d.]+)"', pyproject).group(1)
    assert _version(floor) >= (0, 6, 2)
    assert _version(importlib.metadata.version("safetensors")) >= _version(floor)
    scale = float_to_e8m0(torch.tensor([[2.0**-10, 1.0], [4.0, 2.0**20]]))
    save_file({"w.scale": scale}, str(tmp_path / "s.safetensors"))
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        assert f.get_slice("w.scale").get_dtype() == "F8_E8M0"
        read = f.get_tensor("w.scale")
    assert read.dtype == torch.float8_e8m0fnu
    assert torch.equal(e8m0_to_float(read), torch.tensor([[2.0**-10, 1.0], [4.0, 2.0**20]]))
