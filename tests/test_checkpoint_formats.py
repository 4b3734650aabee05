"""Every released checkpoint format loads: drafts from MXFP4 checkpoints, the stored dtypes, and
checkpoints re-saved by transformers."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import shutil
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


@pytest.mark.parametrize("source", ["official", "hf"])
def test_a_checkpoint_resaved_by_transformers_gives_the_official_logits(tiny_factory, tmp_path, source):
    """``save_pretrained`` writes neither layout: official names under ``model.`` with a few kept in
    memory form (``model.embed_tokens``, ``model.hc_head.*``) and the attention ``kv_norm`` as ``norm``
    after an official load; memory names with every ``kv_norm`` as ``norm`` after a transformers one."""
    transformers = pytest.importorskip("transformers")
    fields = dict(seed=3, layers=4, hca_rate=128)  # transformers knows the ratios 4 and 128 only
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tiny_factory(fmt=source, **fields), dtype=torch.float32
    )
    model.save_pretrained(tmp_path / "resaved")
    resaved = Checkpoint(tmp_path / "resaved")
    assert resaved.layout == "transformers"
    assert any(k.endswith("attn.norm.weight") for k in resaved.stored)
    ids = random_prompt(60, seed=4)
    official = Engine.from_pretrained(tiny_factory(fmt="official", **fields)).score(ids)
    assert torch.equal(Engine.from_pretrained(tmp_path / "resaved").score(ids), official)


def test_the_vision_release_loads_for_text_and_reports_its_image_tensors_once(tiny_dir, tmp_path, caplog):
    path = shutil.copytree(tiny_dir, tmp_path / "vision")
    extra = {
        "vision.blocks.0.attn.qkv.weight": torch.randn(24, 8),
        "aligner.layers.0.weight": torch.randn(64, 8),
        "image_newline": torch.randn(64),
        "layers.3.ffn.gate.bias_vl": torch.randn(8),
        "mtp.0.ffn.gate.bias_vl": torch.randn(8),
    }
    save_file(extra, str(path / "model-vision.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "model-vision.safetensors" for n in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="ds4serve.weights"):
        ckpt = Checkpoint(path)
    assert sorted(ckpt.ignored) == sorted(extra) and not any(ckpt.has(n) for n in extra)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(lines) == 1 and "5 tensors" in lines[0]
    ids = random_prompt(30, seed=5)
    assert torch.equal(Engine.from_pretrained(path).score(ids), Engine.from_pretrained(tiny_dir).score(ids))


def _released_dtype(name: str) -> str:
    """The dtype of an unquantized tensor in the released checkpoints (FP8 ones are checked apart)."""
    if name.endswith("tid2eid"):
        return "I64"
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if leaf.startswith("hc_") or leaf in ("attn_sink", "ape", "bias") or "confidence_head" in name:
        return "F32"
    return "BF16"


@pytest.mark.parametrize("draft", ["mtp", "dspark"])
def test_a_quantized_tiny_checkpoint_is_stored_as_the_released_ones(tiny_factory, draft):
    path = tiny_factory(seed=8, quantize="fp8+fp4", mtp=1 if draft == "mtp" else 0, dspark=draft == "dspark")
    ckpt = Checkpoint(path)
    cfg, block = ckpt.cfg, 32
    fp8 = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared_experts", "e_proj", "h_proj", "main_proj")
    for name, st in ckpt.stored.items():
        if name.endswith(".scale"):
            assert st.dtype == "F8_E8M0", name
        elif ".ffn.experts." in name:  # MXFP4: two codes a byte, one scale per 32 inputs of a row
            assert st.dtype == "I8", name
            assert ckpt.stored[name[:-7] + ".scale"].shape == (st.shape[0], st.shape[1] * 2 // 32), name
        elif any(f".{p}." in name for p in fp8) and "compressor" not in name:
            assert st.dtype == "F8_E4M3", name
            grid = tuple(-(-d // block) for d in st.shape)
            assert ckpt.stored[name[:-7] + ".scale"].shape == grid, name
        else:
            assert st.dtype == _released_dtype(name), name
    assert any(n.startswith("mtp.2." if draft == "dspark" else "mtp.0.") for n in ckpt.stored)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n_drafts = 3 if draft == "dspark" else 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert len(shards) == 1 + cfg.num_layers + 1 + n_drafts
    where = index["weight_map"]
    assert where["embed.weight"] == shards[0] and where["head.weight"] == shards[cfg.num_layers + 1]
    assert (
        where["layers.2.attn.wq_a.weight"] == shards[3]
        and where["mtp.0.attn.wq_a.weight"] == shards[-n_drafts]
    )
