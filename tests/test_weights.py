"""Checkpoint loading: quantized layouts, tid2eid dtypes, and one clear error per bad checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds4serve import Engine
from ds4serve.config import ConfigError, QuantSpec
from ds4serve.tiny import write_checkpoint
from ds4serve.weights import Checkpoint, CheckpointError
from tests.helpers import random_prompt


def _dequantized_copy(src: Path, out: Path) -> Path:
    """The same checkpoint with every tensor dequantized exactly to float32."""
    ckpt = Checkpoint(src)
    tensors = {n: ckpt.dense(n) for n in ckpt.names() if not n.endswith(".scale")}
    tensors = {n: (t.to(torch.int32) if t.dtype == torch.int64 else t) for n, t in tensors.items()}
    cfg = dataclasses.replace(ckpt.cfg, quant=QuantSpec())
    return write_checkpoint(out, cfg, tensors, "official")


@pytest.mark.parametrize("mode", ["fp8", "fp8+fp4"])
def test_quantized_checkpoint_gives_logits_of_its_dequantized_weights(tiny_factory, tmp_path, mode):
    qdir = tiny_factory(seed=4, quantize=mode)
    ckpt = Checkpoint(qdir)
    assert ckpt.raw("layers.2.attn.wq_a.weight").dtype == torch.float8_e4m3fn
    expert = ckpt.raw("layers.3.ffn.experts.0.w1.weight")
    assert expert.dtype == (torch.int8 if mode == "fp8+fp4" else torch.float8_e4m3fn)
    ids = random_prompt(70, seed=1)
    quantized = Engine.from_pretrained(qdir).score(ids)
    plain = Engine.from_pretrained(_dequantized_copy(qdir, tmp_path / "plain")).score(ids)
    assert torch.equal(quantized, plain)


def test_tid2eid_int32_and_no_index_file(tiny_factory, tmp_path):
    """The released shards hold tid2eid as I64; one port writes I32: both route alike."""
    src = tiny_factory(seed=5)
    out = tmp_path / "one_shard"
    out.mkdir()
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    tensors = {n: (t.to(torch.int32) if n.endswith("tid2eid") else t) for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))
    shutil.copy(src / "config.json", out / "config.json")
    ids = random_prompt(20, seed=2)
    assert torch.equal(Engine.from_pretrained(out).score(ids), Engine.from_pretrained(src).score(ids))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path: Path, edit) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(path / shard)
        edit(tensors)
        save_file(tensors, str(path / shard))
    names = {n: s for s in set(index["weight_map"].values()) for n in load_file(path / s)}
    index["weight_map"] = names
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_tensor_is_named(tiny_factory, tmp_path):
    bad = _copy(tiny_factory(seed=6), tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.pop("layers.3.attn.compressor.ape", None))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor layers\.3\.attn\.compressor\.ape \(expected shape \[16, 32\]\)",
    ):
        Checkpoint(bad)


def test_wrong_shape_and_extra_tensor_are_named(tiny_factory, tmp_path):
    bad = _copy(tiny_factory(seed=6), tmp_path / "bad")

    def edit(t: dict) -> None:
        if "layers.1.attn.wkv.weight" in t:
            t["layers.1.attn.wkv.weight"] = torch.zeros(31, 64)
            t["layers.1.attn.surprise"] = torch.zeros(2)

    _edit_tensors(bad, edit)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(bad)
    msg = str(err.value)
    assert "tensor layers.1.attn.wkv.weight: expected shape [32, 64], got [31, 64]" in msg
    assert "unexpected tensor layers.1.attn.surprise" in msg


def _edit_config(src: Path, dst: Path, edit) -> Path:
    out = _copy(src, dst)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.pop("hidden_size"), r"hidden_size: missing"),
        (lambda c: c.update(hidden_size="64"), r"hidden_size: expected an integer, got '64'"),
        (lambda c: c.pop("compress_ratios"), r"layer_types: missing"),
        (lambda c: c.pop("num_hash_layers"), r"num_hash_layers: missing"),
        (lambda c: c.update(compress_ratios=[0, 0, 4, 1, 4, 16]), r"compress_ratios\[3\]: expected 0, 4"),
        (lambda c: c.update(num_key_value_heads=2), r"num_key_value_heads: expected 1"),
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), r"quant_method: expected 'fp8'"),
        (
            lambda c: c.update(rope_scaling={"type": "yarn", "factor": 16}),
            r"original_max_position_embeddings: missing",
        ),
    ],
)
def test_malformed_official_config(tiny_factory, tmp_path, edit, message):
    bad = _edit_config(tiny_factory(seed=6), tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=message):
        Checkpoint(bad)


def test_unknown_layer_type_in_hf_config(tiny_factory, tmp_path):
    def edit(c: dict) -> None:
        c["layer_types"][2] = "full_attention"

    bad = _edit_config(tiny_factory(seed=6, fmt="hf"), tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=r"layer_types: expected entries from .*got \['full_attention'\]"):
        Checkpoint(bad)


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        Checkpoint(tmp_path)
