"""Loading a directory of safetensors shards in the official or the transformers layout.

Everything inside ds4serve uses the *official* tensor names (``layers.L.attn.wq_a.weight``...).
A transformers-layout checkpoint is read through a name map (and its stacked ``gate_up_proj`` /
``down_proj`` expert tensors are viewed per expert), so both layouts produce the same tensors.

Tensors are memory-mapped by safetensors and read one at a time. :meth:`Checkpoint.dense`
dequantizes FP8 / MXFP4 exactly; :meth:`Checkpoint.raw` hands out the stored tensors so that GPU
kernels can keep them quantized.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import CSA, SLIDING, ModelConfig
from .quant import FP4_BLOCK, dequant_fp4, dequant_fp8


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config. The message lists every offending name."""


# official suffix (inside ``layers.L.``) <-> transformers suffix (inside ``model.layers.L.``)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_HF_TO_OFFICIAL_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TO_OFFICIAL_TOP = {v: k for k, v in _TOP_NAMES.items()}
# A routed expert's matrix or scale, in the trunk (``layers.L``) or a draft block (``mtp.K``: MTP and DSpark).
_EXPERT_RE = re.compile(r"^(?:layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")

# Dense projections stored as FP8 in official checkpoints (``make-tiny --quantize`` mirrors this).
FP8_LAYER_WEIGHTS = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
)


def official_to_hf(name: str) -> str:
    """Transformers name of an official tensor name (experts excluded: they are stacked)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(name)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical (dequantized) shape of every main-model tensor, by official name."""
    D, hc = cfg.hidden_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, D),
        "head.weight": (cfg.vocab_size, D),
        "norm.weight": (D,),
        "hc_head_fn": (hc, hc * D),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for layer in range(cfg.num_layers):
        shapes.update({f"layers.{layer}.{k}": v for k, v in block_shapes(cfg, layer).items()})
    return shapes


def block_shapes(
    cfg: ModelConfig, layer: int, layer_type: str | None = None, hash_moe: bool | None = None
) -> dict[str, tuple[int, ...]]:
    """Shapes of one transformer block's tensors (names relative to the block prefix)."""
    D, H, hd, q, hc = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    E, inter = cfg.n_routed_experts, cfg.moe_inter
    kind = layer_type if layer_type is not None else cfg.layer_types[layer]
    is_hash = hash_moe if hash_moe is not None else cfg.is_hash_layer(layer)
    mix = (2 + hc) * hc
    s: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (D,),
        "ffn_norm.weight": (D,),
        "hc_attn_fn": (mix, hc * D),
        "hc_attn_base": (mix,),
        "hc_attn_scale": (3,),
        "hc_ffn_fn": (mix, hc * D),
        "hc_ffn_base": (mix,),
        "hc_ffn_scale": (3,),
        "attn.wq_a.weight": (q, D),
        "attn.q_norm.weight": (q,),
        "attn.wq_b.weight": (H * hd, q),
        "attn.wkv.weight": (hd, D),
        "attn.kv_norm.weight": (hd,),
        "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
        "attn.wo_b.weight": (D, cfg.o_groups * cfg.o_lora_rank),
        "attn.attn_sink": (H,),
        "ffn.gate.weight": (E, D),
        "ffn.shared_experts.w1.weight": (inter, D),
        "ffn.shared_experts.w3.weight": (inter, D),
        "ffn.shared_experts.w2.weight": (D, inter),
    }
    if kind != SLIDING:
        width = 2 * hd if kind == CSA else hd
        rate = cfg.csa_rate if kind == CSA else cfg.hca_rate
        s.update(
            {
                "attn.compressor.wkv.weight": (width, D),
                "attn.compressor.wgate.weight": (width, D),
                "attn.compressor.ape": (rate, width),
                "attn.compressor.norm.weight": (hd,),
            }
        )
    if kind == CSA:
        ihd = cfg.index_head_dim
        s.update(
            {
                "attn.indexer.wq_b.weight": (cfg.index_n_heads * ihd, q),
                "attn.indexer.weights_proj.weight": (cfg.index_n_heads, D),
                "attn.indexer.compressor.wkv.weight": (2 * ihd, D),
                "attn.indexer.compressor.wgate.weight": (2 * ihd, D),
                "attn.indexer.compressor.ape": (cfg.csa_rate, 2 * ihd),
                "attn.indexer.compressor.norm.weight": (ihd,),
            }
        )
    if is_hash:
        s["ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.top_k)
    else:
        s["ffn.gate.bias"] = (E,)
    for e in range(E):
        s[f"ffn.experts.{e}.w1.weight"] = (inter, D)
        s[f"ffn.experts.{e}.w3.weight"] = (inter, D)
        s[f"ffn.experts.{e}.w2.weight"] = (D, inter)
    return s


@dataclass
class _Source:
    """Where one logical tensor lives: a key in a shard, optionally a slice of it."""

    shard: Path
    key: str
    index: tuple | None = None  # a slice of the stored tensor (stacked transformers experts)


class Checkpoint:
    """A checkpoint directory opened lazily; tensors are addressed by their official names."""

    def __init__(self, path: str | Path, cfg: ModelConfig | None = None):
        self.path = Path(path)
        self.cfg = cfg if cfg is not None else ModelConfig.from_dir(self.path)
        self._handles: dict[Path, object] = {}
        stored = self._scan()
        self.layout = (
            "hf" if any(k.startswith("model.") or k == "lm_head.weight" for k in stored) else "official"
        )
        self.sources: dict[str, _Source] = (
            self._hf_sources(stored) if self.layout == "hf" else {k: _Source(p, k) for k, p in stored.items()}
        )
        self._validate()

    # ---- discovery -----------------------------------------------------------------------------
    def _scan(self) -> dict[str, Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(
                    f"{index.name}: expected a JSON object with 'weight_map' ({exc})"
                ) from exc
            return {k: self.path / v for k, v in weight_map.items()}
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        found: dict[str, Path] = {}
        for shard in shards:
            for key in self._handle(shard).keys():
                found[key] = shard
        return found

    def _handle(self, shard: Path):
        if shard not in self._handles:
            if not shard.is_file():
                raise CheckpointError(f"{shard.name}: named in the index but missing on disk")
            self._handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
        return self._handles[shard]

    def _hf_sources(self, stored: dict[str, Path]) -> dict[str, _Source]:
        out: dict[str, _Source] = {}
        inter = self.cfg.moe_inter
        for key, shard in stored.items():
            if key.endswith(".weight_scale_inv"):
                base = key[: -len("_scale_inv")]
                name = self._hf_name(base)
                if name is not None:
                    out[name[: -len(".weight")] + ".scale"] = _Source(shard, key)
                continue
            m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", key)
            if m:
                layer = int(m.group(1))
                n_exp = self._handle(shard).get_slice(key).get_shape()[0]
                for e in range(n_exp):
                    prefix = f"layers.{layer}.ffn.experts.{e}"
                    if m.group(2) == "gate_up_proj":
                        out[f"{prefix}.w1.weight"] = _Source(shard, key, (e, slice(0, inter)))
                        out[f"{prefix}.w3.weight"] = _Source(shard, key, (e, slice(inter, 2 * inter)))
                    else:
                        out[f"{prefix}.w2.weight"] = _Source(shard, key, (e,))
                continue
            name = self._hf_name(key)
            out[name if name is not None else key] = _Source(shard, key)
        return out

    @staticmethod
    def _hf_name(key: str) -> str | None:
        if key in _HF_TO_OFFICIAL_TOP:
            return _HF_TO_OFFICIAL_TOP[key]
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", key)
        if m and m.group(2) in _HF_TO_OFFICIAL_LAYER:
            return f"layers.{m.group(1)}.{_HF_TO_OFFICIAL_LAYER[m.group(2)]}"
        if key.startswith("mtp.") or key.startswith("model.mtp."):
            return key.removeprefix("model.")
        return None

    # ---- validation ----------------------------------------------------------------------------
    def stored_shape(self, name: str) -> tuple[int, ...]:
        src = self.sources[name]
        shape = list(self._handle(src.shard).get_slice(src.key).get_shape())
        if src.index is not None:
            for i, idx in enumerate(src.index):
                shape[i] = -1 if isinstance(idx, int) else len(range(*idx.indices(shape[i])))
            shape = [d for d in shape if d != -1]
        return tuple(shape)

    def stored_dtype(self, name: str) -> str:
        src = self.sources[name]
        return self._handle(src.shard).get_slice(src.key).get_dtype()

    def _logical_shape(self, name: str) -> tuple[int, ...]:
        shape = self.stored_shape(name)
        if _EXPERT_RE.match(name) and self.stored_dtype(name) in ("I8", "U8"):
            return (*shape[:-1], shape[-1] * 2)  # MXFP4: two codes per byte
        return shape

    def _validate(self) -> None:
        expected = expected_shapes(self.cfg)
        problems: list[str] = []
        for name, shape in expected.items():
            if name not in self.sources:
                problems.append(f"missing tensor {name} (expected shape {list(shape)})")
                continue
            actual = self._logical_shape(name)
            if actual != shape:
                problems.append(f"tensor {name}: expected shape {list(shape)}, got {list(actual)}")
            if self.stored_dtype(name) == "F8_E4M3" and _scale_name(name) not in self.sources:
                problems.append(f"tensor {name} is FP8 but {_scale_name(name)} is missing")
        for name in self.sources:
            if name in expected or name.endswith(".scale") or name.startswith("mtp."):
                continue
            problems.append(f"unexpected tensor {name} (shape {list(self.stored_shape(name))})")
        if problems:
            head = f"{self.path}: checkpoint does not match its config.json ({len(problems)} problem(s)):\n  "
            raise CheckpointError(head + "\n  ".join(problems[:50]))

    # ---- reading -------------------------------------------------------------------------------
    def names(self) -> Iterator[str]:
        return iter(self.sources)

    def storage_format(self, name: str) -> str | None:
        """``"fp8"`` or ``"fp4"`` (MXFP4 expert) for a tensor that a quantized load keeps quantized, None
        for one it loads dense; from the file's header, without reading the tensor."""
        dt = self.stored_dtype(name)
        if dt == "F8_E4M3":
            return "fp8"
        if dt in ("I8", "U8") and _EXPERT_RE.match(name):
            return "fp4"
        return None

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor, as on disk (memory-mapped; FP8 / MXFP4 stay quantized)."""
        src = self.sources[name]
        handle = self._handle(src.shard)
        if src.index is None:
            return handle.get_tensor(src.key)
        return handle.get_slice(src.key)[src.index]

    def has(self, name: str) -> bool:
        return name in self.sources

    def dense(
        self, name: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """The tensor dequantized exactly to ``dtype`` (integer tensors keep their values as int64)."""
        t = self.raw(name)
        if t.dtype == torch.float8_e4m3fn:
            block = self.cfg.quant.fp8_block or _infer_block(t.shape, self.raw(_scale_name(name)).shape)
            t = dequant_fp8(t, self.raw(_scale_name(name)), block, torch.float32)
        elif t.dtype in (torch.int8, torch.uint8) and _EXPERT_RE.match(name):
            t = dequant_fp4(t, self.raw(_scale_name(name)), torch.float32)
        elif t.dtype in (torch.int32, torch.int64, torch.int16):
            return t.to(device=device, dtype=torch.int64)
        return t.to(device=device, dtype=dtype)

    def quantized(self, name: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None] | None:
        """``(data, scale, block)`` of an FP8 tensor, ``(packed, scale, None)`` of an MXFP4 expert, as
        stored; None for a tensor stored unquantized."""
        t = self.raw(name)
        if t.dtype == torch.float8_e4m3fn:
            scale = self.raw(_scale_name(name))
            return t, scale, self.cfg.quant.fp8_block or _infer_block(t.shape, scale.shape)
        if t.dtype in (torch.int8, torch.uint8) and _EXPERT_RE.match(name):
            return t, self.raw(_scale_name(name)), None
        return None

    def experts(
        self, prefix: str, which: str, dtype: torch.dtype, device: str | torch.device
    ) -> torch.Tensor:
        """Routed experts' ``which`` (w1 / w2 / w3) weights of block ``prefix`` stacked: ``[E, out, in]``."""
        return torch.stack(
            [
                self.dense(f"{prefix}.ffn.experts.{e}.{which}.weight", dtype, device)
                for e in range(self.cfg.n_routed_experts)
            ]
        )

    def tensors_with_prefix(self, prefix: str) -> list[str]:
        return [n for n in self.sources if n.startswith(prefix)]


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def _infer_block(weight_shape: torch.Size, scale_shape: torch.Size) -> tuple[int, int]:
    return (-(-weight_shape[0] // scale_shape[0]), -(-weight_shape[1] // scale_shape[1]))


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "expected_shapes",
    "block_shapes",
    "official_to_hf",
    "FP8_LAYER_WEIGHTS",
    "FP4_BLOCK",
]
