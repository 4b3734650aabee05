"""``ds4serve inspect`` reads the shards' headers only and counts logical parameters: an MXFP4 byte
holds two, block scales and hash-routing tables are not parameters, and a token's active parameters
leave out the routed experts it does not select."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from ds4serve.cli import main
from ds4serve.config import ModelConfig
from ds4serve.tiny import draft_shapes
from ds4serve.weights import Checkpoint, expected_shapes, parameter_counts


def _logical(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for n, s in shapes.items() if not n.endswith("tid2eid"))


def _headers_only(src, dst):
    """A copy of ``src`` whose shards end where their data would begin."""
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        raw = shard.read_bytes()
        shard.write_bytes(raw[: 8 + int.from_bytes(raw[:8], "little")])
    return dst


@pytest.mark.parametrize("quantize", ["none", "fp8", "fp8+fp4"])
def test_inspect_counts_logical_parameters_from_headers_alone(tiny_factory, tmp_path, capsys, quantize):
    src = tiny_factory(seed=9, quantize=quantize, mtp=1)
    total_bytes = json.loads((src / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    path = _headers_only(src, tmp_path / "headers")
    cfg = ModelConfig.from_dir(path)
    main_params, drafts = _logical(expected_shapes(cfg)), _logical(draft_shapes(cfg))
    routed = 3 * cfg.hidden_size * cfg.moe_inter * cfg.n_routed_experts * cfg.num_layers
    active = main_params - routed + routed * cfg.top_k // cfg.n_routed_experts

    counts = parameter_counts(Checkpoint(path))
    assert (counts.main, counts.drafts, counts.active) == (main_params, drafts, active)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"{main_params + drafts:,} = {main_params:,} main + {drafts:,} drafts" in text
    assert f"active per token {active:,}" in text
    assert f"{total_bytes / 1e6:,.1f} MB" in text
    if quantize == "fp8+fp4":
        assert "F8_E4M3" in text and "F8_E8M0" in text and "I8" in text


def test_inspect_gives_a_sequences_state_size_by_context(tiny_factory, capsys):
    """The state line's sizes are those of a real state allocated at that context (the sparse layers'
    compressed entries grow with it, the sliding windows do not)."""
    import torch

    from ds4serve.state import SequenceState, state_nbytes

    path = tiny_factory(seed=9)
    cfg = ModelConfig.from_dir(path)
    layers = range(cfg.num_layers)
    for n in (4096, cfg.max_position_embeddings):
        real = SequenceState.allocate(cfg, layers, n, torch.bfloat16, "cpu").nbytes()
        assert state_nbytes(cfg, layers, n, torch.bfloat16) == real
    small, large = (state_nbytes(cfg, layers, n, torch.bfloat16) for n in (4096, 131072))
    assert large > small
    assert main(["inspect", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("state"))
    assert f"4,096 tokens {small / 2**20:,.1f} MiB" in line
    assert f"{min(131072, cfg.max_position_embeddings):,} tokens" in line
