"""Tiny random checkpoints of the real DeepSeek-V4 architecture (tests, demos, the default model).

The defaults exercise every part of the model: sliding, CSA and HCA layers, hash-routed layers,
an HCA ratio small enough that a 200-token prompt closes many windows, and an ``index_topk``
small enough that the lightning indexer is selective. The vocabulary and tokenizer are the real
ones (129,280 tokens), so chat formatting and special tokens behave as with the full model.

A quantized tiny checkpoint (``fp8``, ``fp8+fp4``) is stored as the released ones are: the same
names, dtypes (F8_E4M3 with F8_E8M0 block scales, MXFP4 experts as I8 with F8_E8M0 scales, BF16 /
F32 elsewhere, I64 ``tid2eid``), packing, shard and index names, with the MTP and DSpark blocks
quantized like the trunk. ``none`` keeps every weight in float32: an exact reference.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import CSA, HCA, SLIDING, DSparkSpec, ModelConfig, QuantSpec, RopeSpec
from .quant import quant_fp4, quant_fp8
from .tokenizer import bundled_tokenizer_dir
from .weights import FP8_LAYER_WEIGHTS, block_shapes, expected_shapes, official_to_hf

QUANT_MODES = ("none", "fp8", "fp8+fp4")
FORMATS = ("official", "hf")
TINY_FP8_BLOCK = (32, 32)


@dataclass
class TinySpec:
    seed: int = 0
    layers: int = 6
    experts: int = 8
    top_k: int = 3
    hidden: int = 64
    heads: int = 4
    head_dim: int = 32
    rope_dim: int = 16
    window: int = 16
    hca_rate: int = 16
    index_topk: int = 8
    index_heads: int = 16
    index_head_dim: int = 32
    mtp: int = 0
    dspark: bool = False
    fmt: str = "official"
    quantize: str = "none"


def tiny_config(spec: TinySpec) -> ModelConfig:
    """The config of a tiny checkpoint: layers 0-1 sliding, then CSA and HCA alternating."""
    if spec.layers < 1:
        raise ValueError(f"--layers: expected at least 1, got {spec.layers}")
    if spec.top_k > spec.experts:
        raise ValueError(f"--experts: expected at least top_k={spec.top_k}, got {spec.experts}")
    types = [SLIDING if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(spec.layers)]
    n_hash = min(3, spec.layers)
    dspark = None
    if spec.dspark:
        targets = tuple(sorted({max(0, spec.layers - 3), max(0, spec.layers - 2), spec.layers - 1}))
        dspark = DSparkSpec(block_size=5, noise_token_id=128799, target_layer_ids=targets, markov_rank=16)
    return ModelConfig(
        vocab_size=129280,
        hidden_size=spec.hidden,
        num_layers=spec.layers,
        num_heads=spec.heads,
        head_dim=spec.head_dim,
        rope_dim=spec.rope_dim,
        q_lora_rank=32,
        o_lora_rank=16,
        o_groups=2,
        moe_inter=32,
        n_routed_experts=spec.experts,
        n_shared_experts=1,
        top_k=spec.top_k,
        routed_scaling_factor=1.5,
        swiglu_limit=1.5,
        sliding_window=spec.window,
        layer_types=tuple(types),
        mlp_types=tuple(["hash_moe"] * n_hash + ["moe"] * (spec.layers - n_hash)),
        csa_rate=4,
        hca_rate=spec.hca_rate,
        rope_main=RopeSpec(10000.0),
        rope_compress=RopeSpec(160000.0, yarn_factor=16.0, original_max_position=65536),
        index_n_heads=spec.index_heads,
        index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        max_position_embeddings=65536,
        n_mtp_layers=spec.mtp,
        quant=quant_spec(spec.quantize),
        dspark=dspark,
    )


def quant_spec(quantize: str) -> QuantSpec:
    """The quantization of a tiny checkpoint written with ``--quantize quantize`` (one of QUANT_MODES)."""
    if quantize == "none":
        return QuantSpec()
    return QuantSpec(TINY_FP8_BLOCK, "fp4" if quantize == "fp8+fp4" else "fp8")


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, cfg: ModelConfig) -> torch.Tensor:
    """A random tensor whose scale keeps activations O(1) through the tiny network."""
    if name.endswith("tid2eid"):
        return (
            torch.rand(shape[0], cfg.n_routed_experts, generator=gen)
            .argsort(-1)[:, : shape[1]]
            .to(torch.int64)
        )
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("_fn", "hc_head_fn")):
        return torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[-1]))
    if name.endswith(("_base", "_scale")):
        return (1.0 if name.endswith("_scale") else 0.0) + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("attn_sink", ".ape")):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("gate.bias"):
        return torch.randn(shape, generator=gen) * 0.1
    if name == "embed.weight":
        return torch.randn(shape, generator=gen)
    if len(shape) == 2:
        return torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    raise AssertionError(f"no initialiser for {name} {shape}")


def draft_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the ``mtp.K.*`` tensors of the MTP next-n blocks."""
    D, hc = cfg.hidden_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(cfg.n_mtp_layers):
        p = f"mtp.{k}."
        shapes.update(
            {
                p + "e_proj.weight": (D, D),
                p + "h_proj.weight": (D, D),
                p + "enorm.weight": (D,),
                p + "hnorm.weight": (D,),
                p + "norm.weight": (D,),
                p + "hc_head_fn": (hc, hc * D),
                p + "hc_head_base": (hc,),
                p + "hc_head_scale": (1,),
            }
        )
        shapes.update({p + n: s for n, s in block_shapes(cfg, 0, SLIDING, hash_moe=False).items()})
    return shapes


def random_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Float32 random weights (official names; ``tid2eid`` int64) for every tensor the config implies."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {**expected_shapes(cfg), **draft_shapes(cfg)}
    return {name: _init(name, shape, gen, cfg) for name, shape in shapes.items()}


def _released_dtype(name: str) -> torch.dtype:
    """The dtype a released (FP8) checkpoint stores an unquantized tensor in: the mHC mixers, attention
    sinks, compressor position biases, router biases and the DSpark confidence head in F32, the rest
    (embedding, head, norms, routers, compressor and indexer projections, the Markov head) in BF16."""
    if name.endswith(
        ("_fn", "_base", "_scale", "attn_sink", ".ape", "gate.bias", "confidence_head.proj.weight")
    ):
        return torch.float32
    return torch.bfloat16


def _quantize(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors as a released checkpoint stores them: FP8 projections (trunk, MTP and DSpark
    blocks alike), FP8 or MXFP4 routed experts, each with its F8_E8M0 scales, the rest in
    :func:`_released_dtype` and ``tid2eid`` in I64."""
    out: dict[str, torch.Tensor] = {}
    block = cfg.quant.fp8_block
    for name, t in tensors.items():
        suffix = name.split(".", 2)[-1] if name.startswith(("layers.", "mtp.")) else name
        is_expert = ".ffn.experts." in name
        base = name[: -len(".weight")]
        if is_expert and cfg.quant.expert_dtype == "fp4":
            out[name], out[base + ".scale"] = quant_fp4(t)
        elif is_expert or suffix in FP8_LAYER_WEIGHTS or suffix in _FP8_DRAFT_WEIGHTS:
            out[name], out[base + ".scale"] = quant_fp8(t, block)
        elif t.is_floating_point():
            out[name] = t.to(_released_dtype(name))
        else:
            out[name] = t
    return out


# Draft projections stored as FP8 besides FP8_LAYER_WEIGHTS: MTP's e_proj / h_proj, DSpark's main_proj.
_FP8_DRAFT_WEIGHTS = ("e_proj.weight", "h_proj.weight", "main_proj.weight")


def _to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".ffn.experts." in name or name.startswith("mtp."):
            continue
        out[official_to_hf(name)] = t
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}.ffn.experts"
        w1 = torch.stack([tensors[f"{p}.{e}.w1.weight"] for e in range(cfg.n_routed_experts)])
        w3 = torch.stack([tensors[f"{p}.{e}.w3.weight"] for e in range(cfg.n_routed_experts)])
        w2 = torch.stack([tensors[f"{p}.{e}.w2.weight"] for e in range(cfg.n_routed_experts)])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = w2
    out.update({n: t for n, t in tensors.items() if n.startswith("mtp.")})
    return out


def _shard_groups(names: list[str]) -> list[list[str]]:
    """Names by shard, as the released checkpoints are sharded: the embedding, then one shard per
    layer, then the final merge, norm and head, then one shard per ``mtp.K`` block."""
    embed, head = [], []
    layers: dict[int, list[str]] = {}
    drafts: dict[int, list[str]] = {}
    for name in names:
        bare = name.removeprefix("model.")
        kind, _, rest = bare.partition(".")
        if kind in ("layers", "mtp"):
            (layers if kind == "layers" else drafts).setdefault(int(rest.partition(".")[0]), []).append(name)
        elif bare.startswith("embed"):
            embed.append(name)
        else:
            head.append(name)
    return [embed, *(layers[k] for k in sorted(layers)), head, *(drafts[k] for k in sorted(drafts))]


def write_checkpoint(
    out_dir: str | Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], fmt: str
) -> Path:
    """Write ``config.json``, the safetensors shards (``model-0000i-of-0000n.safetensors``, grouped
    as :func:`_shard_groups`) with ``model.safetensors.index.json``, and the tokenizer files."""
    if fmt not in FORMATS:
        raise ValueError(f"--format: expected one of {FORMATS}, got {fmt!r}")
    if fmt == "hf":
        if cfg.quant.fp8_block is not None:
            raise ValueError(
                "--format hf: only --quantize none is supported (quantized checkpoints are official)"
            )
        tensors = _to_hf(tensors, cfg)
        config = cfg.to_hf_dict()
    else:
        config = cfg.to_official_dict()
    ModelConfig.from_dict(
        config
    )  # what a load would refuse (a negative --mtp, a zero --window) is refused here
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    groups = _shard_groups(sorted(tensors))
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_tokenizer_dir() / f, out / f)
    return out


def make_tiny(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Create a tiny random checkpoint directory and return its path."""
    spec = spec or TinySpec()
    if spec.quantize not in QUANT_MODES:
        raise ValueError(f"--quantize: expected one of {QUANT_MODES}, got {spec.quantize!r}")
    cfg = tiny_config(spec)
    tensors = random_tensors(cfg, spec.seed)
    if spec.dspark:
        if spec.mtp:
            raise ValueError("--dspark: the DSpark stages occupy mtp.0-2, so --mtp must be 0")
        from .engine.dspark_weights import dspark_random_tensors  # provided by the speculative engine

        tensors.update(dspark_random_tensors(cfg, spec.seed))
    if spec.quantize != "none":
        tensors = _quantize(tensors, cfg)
    return write_checkpoint(out_dir, cfg, tensors, spec.fmt)
