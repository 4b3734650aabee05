"""Model configuration read from a checkpoint's ``config.json``.

Two layouts exist for DeepSeek-V4 checkpoints:

* the official one (V3-style keys: ``compress_ratios``, ``num_hash_layers``, ``rope_scaling``,
  ``num_nextn_predict_layers``, ``quantization_config``, ``expert_dtype``, DSpark fields), and
* the transformers one (``layer_types``, ``mlp_layer_types``, ``rope_parameters``, ``compress_rates``).

Both are normalised into one :class:`ModelConfig`. The layer patterns always come from the
checkpoint: a config that names neither ``compress_ratios`` nor ``layer_types``, or neither
``num_hash_layers`` nor ``mlp_layer_types``, is rejected rather than silently given a default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")


class ConfigError(ValueError):
    """A config.json field is missing or invalid. The message names the field."""


ARCHITECTURE, MODEL_TYPE = "DeepseekV4ForCausalLM", "deepseek_v4"  # what released configs declare


def _check_architecture(raw: dict[str, Any]) -> None:
    """A config that declares another model (``architectures``, ``model_type``) is refused; one that declares
    none is read as DeepSeek-V4."""
    model_type = raw.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ConfigError(
            f"model_type: expected {MODEL_TYPE!r} (a DeepSeek-V4 checkpoint), got {model_type!r}"
        )
    archs = raw.get("architectures", [ARCHITECTURE])
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise ConfigError(
            f"architectures: expected [{ARCHITECTURE!r}] (a DeepSeek-V4 checkpoint), got {archs!r}"
        )


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: base, and the YaRN parameters when YaRN is on (``factor`` > 1)."""

    theta: float
    yarn_factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @property
    def is_yarn(self) -> bool:
        return self.yarn_factor != 1.0 and self.original_max_position > 0

    def inv_freq(self, rope_dim: int) -> "Any":
        """Per-pair angular frequencies (fp32), exactly as transformers computes them."""
        import torch

        pos_freqs = self.theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
        extrapolation = 1.0 / pos_freqs
        if not self.is_yarn:
            return extrapolation
        interpolation = 1.0 / (self.yarn_factor * pos_freqs)

        def correction_dim(rotations: float) -> float:
            return (rope_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return interpolation * (1 - keep) + extrapolation * keep


@dataclass(frozen=True)
class QuantSpec:
    """How dense and expert weights are stored in the checkpoint."""

    fp8_block: tuple[int, int] | None = None  # (rows, cols) of one FP8 scale block, None = no FP8
    expert_dtype: str = "bf16"  # "bf16" | "fp8" | "fp4"


@dataclass(frozen=True)
class DSparkSpec:
    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    moe_inter: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    rope_main: RopeSpec
    rope_compress: RopeSpec
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int = 0
    eos_token_id: int = 1
    n_mtp_layers: int = 0
    quant: QuantSpec = field(default_factory=QuantSpec)
    dspark: DSparkSpec | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------
    def compress_rate(self, layer: int) -> int:
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]

    def is_hash_layer(self, layer: int) -> bool:
        return self.mlp_types[layer] == "hash_moe"

    def rope_for(self, layer_type: str) -> RopeSpec:
        return self.rope_main if layer_type == SLIDING else self.rope_compress

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ConfigError(f"config.json: not found at {cfg_file}")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config.json: not valid JSON ({exc})") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError("config.json: expected a JSON object at the top level")
        _check_architecture(raw)
        r = _Reader(raw)
        n_layers = r.int("num_hidden_layers", minimum=1)
        hidden = r.int("hidden_size", minimum=1)
        heads = r.int("num_attention_heads", minimum=1)
        head_dim = r.int("head_dim", minimum=2)
        kv_heads = r.int("num_key_value_heads", default=1)
        if kv_heads != 1:
            raise ConfigError(f"num_key_value_heads: expected 1 (shared K=V), got {kv_heads}")

        rope_dim = _rope_dim(raw, head_dim)
        layer_types, csa_rate, hca_rate = _layer_pattern(raw, n_layers)
        mlp_types = _mlp_pattern(raw, n_layers)
        rope_main, rope_compress = _rope_specs(raw)
        n_mtp = raw.get("num_nextn_predict_layers", raw.get("n_mtp_layers", 0)) or 0
        if not isinstance(n_mtp, int) or n_mtp < 0:
            raise ConfigError(f"num_nextn_predict_layers: expected a non-negative integer, got {n_mtp!r}")
        scoring = raw.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ConfigError(f"scoring_func: expected 'sqrtsoftplus', got {scoring!r}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act: expected 'silu', got {act!r}")
        if raw.get("tie_word_embeddings", False):
            raise ConfigError("tie_word_embeddings: expected false (DeepSeek-V4 has a separate head)")

        cfg = cls(
            vocab_size=r.int("vocab_size", minimum=2),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=r.int("q_lora_rank", minimum=1),
            o_lora_rank=r.int("o_lora_rank", minimum=1),
            o_groups=r.int("o_groups", minimum=1),
            moe_inter=r.int("moe_intermediate_size", minimum=1, alias="intermediate_size"),
            n_routed_experts=r.int("n_routed_experts", minimum=1, alias="num_local_experts"),
            n_shared_experts=r.int("n_shared_experts", default=1),
            top_k=r.int("num_experts_per_tok", minimum=1),
            routed_scaling_factor=r.float("routed_scaling_factor", default=1.0),
            swiglu_limit=r.float("swiglu_limit", default=0.0),
            sliding_window=r.int("sliding_window", minimum=1),
            layer_types=layer_types,
            mlp_types=mlp_types,
            csa_rate=csa_rate,
            hca_rate=hca_rate,
            rope_main=rope_main,
            rope_compress=rope_compress,
            index_n_heads=r.int("index_n_heads", minimum=1, default=64),
            index_head_dim=r.int("index_head_dim", minimum=2, default=128),
            index_topk=r.int("index_topk", minimum=1, default=512),
            hc_mult=r.int("hc_mult", minimum=1, default=4),
            hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", minimum=1, default=20),
            hc_eps=r.float("hc_eps", default=1e-6),
            rms_norm_eps=r.float("rms_norm_eps", default=1e-6),
            max_position_embeddings=r.int("max_position_embeddings", minimum=1, default=1 << 20),
            bos_token_id=r.int("bos_token_id", default=0),
            eos_token_id=_eos(raw),
            n_mtp_layers=n_mtp,
            quant=_quant(raw),
            dspark=_dspark(raw),
            raw=raw,
        )
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.num_heads * self.head_dim % self.o_groups:
            raise ConfigError(
                f"o_groups: expected a divisor of num_attention_heads*head_dim={self.num_heads * self.head_dim}, "
                f"got {self.o_groups}"
            )
        if self.top_k > self.n_routed_experts:
            raise ConfigError(
                f"num_experts_per_tok: expected at most n_routed_experts={self.n_routed_experts}, got {self.top_k}"
            )
        if self.rope_dim > self.index_head_dim and CSA in self.layer_types:
            raise ConfigError(
                f"index_head_dim: expected at least the rope dim {self.rope_dim}, got {self.index_head_dim}"
            )
        if self.dspark is not None:
            bad = [i for i in self.dspark.target_layer_ids if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(
                    f"dspark_target_layer_ids: expected layer indices in [0, {self.num_layers}), got {bad}"
                )

    def to_official_dict(self) -> dict[str, Any]:
        """The official-layout config.json for this config (used by ``make-tiny``)."""
        ratio = {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            **self._common_dict(),
            "qk_rope_head_dim": self.rope_dim,
            "compress_ratios": [ratio[t] for t in self.layer_types] + [0] * self.n_mtp_layers,
            "num_hash_layers": self.mlp_types.count("hash_moe"),
            "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "num_nextn_predict_layers": self.n_mtp_layers,
        }
        if self.rope_compress.is_yarn:
            out["rope_scaling"] = _yarn_dict(self.rope_compress)
        out.update(_quant_dict(self.quant))
        if self.dspark is not None:
            out.update(_dspark_dict(self.dspark))
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-layout config.json for this config."""
        compress: dict[str, Any] = {"rope_theta": self.rope_compress.theta, "rope_type": "default"}
        if self.rope_compress.is_yarn:
            compress = {
                **_yarn_dict(self.rope_compress),
                "rope_theta": self.rope_compress.theta,
                "rope_type": "yarn",
                "attention_factor": 1.0,
            }
        factor = self.rope_dim / self.head_dim
        compress["partial_rotary_factor"] = factor
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            **self._common_dict(),
            "partial_rotary_factor": factor,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_types),
            "compress_rates": {CSA: self.csa_rate, HCA: self.hca_rate},
            "rope_theta": self.rope_main.theta,
            "compress_rope_theta": self.rope_compress.theta,
            "rope_parameters": {
                "main": {
                    "rope_type": "default",
                    "rope_theta": self.rope_main.theta,
                    "partial_rotary_factor": factor,
                },
                "compress": compress,
            },
            "num_nextn_predict_layers": self.n_mtp_layers,
        }
        out.update(_quant_dict(self.quant))
        if self.dspark is not None:
            out.update(_dspark_dict(self.dspark))
        return out

    def _common_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_lora_rank": self.o_lora_rank,
            "o_groups": self.o_groups,
            "moe_intermediate_size": self.moe_inter,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.top_k,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hidden_act": "silu",
            "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
        }


# ---- helpers ------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def _get(self, name: str, default: Any, alias: str | None) -> Any:
        if name in self.raw:
            return self.raw[name]
        if alias is not None and alias in self.raw:
            return self.raw[alias]
        if default is _MISSING:
            raise ConfigError(f"{name}: missing from config.json")
        return default

    def int(
        self, name: str, *, minimum: int | None = None, default: Any = None, alias: str | None = None
    ) -> int:
        value = self._get(name, _MISSING if default is None else default, alias)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{name}: expected an integer >= {minimum}, got {value}")
        return value

    def float(self, name: str, *, default: Any = None) -> float:
        value = self._get(name, _MISSING if default is None else default, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)


_MISSING = object()


def _rope_dim(raw: dict[str, Any], head_dim: int) -> int:
    if "qk_rope_head_dim" in raw:
        dim = raw["qk_rope_head_dim"]
    elif raw.get("partial_rotary_factor") is not None:
        dim = round(head_dim * float(raw["partial_rotary_factor"]))
    else:
        dim = head_dim // 8
    if not isinstance(dim, int) or dim <= 0 or dim % 2 or dim > head_dim:
        raise ConfigError(
            f"qk_rope_head_dim: expected an even integer in (0, head_dim={head_dim}], got {dim!r}"
        )
    return dim


def _layer_pattern(raw: dict[str, Any], n_layers: int) -> tuple[tuple[str, ...], int, int]:
    rates = raw.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"compress_rates: expected an object mapping layer type to rate, got {rates!r}")
    csa_rate = int(rates.get(CSA, raw.get("compress_rate_csa", 4)))
    hca_rate = int(rates.get(HCA, raw.get("compress_rate_hca", 128)))
    if "layer_types" in raw and raw["layer_types"] is not None:
        types = raw["layer_types"]
        if not isinstance(types, list) or len(types) < n_layers:
            raise ConfigError(
                f"layer_types: expected a list of at least num_hidden_layers={n_layers} entries, got {types!r}"
            )
        bad = [t for t in types[:n_layers] if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types: expected entries from {list(LAYER_TYPES)}, got {bad}")
        return tuple(types[:n_layers]), csa_rate, hca_rate
    if "compress_ratios" in raw and raw["compress_ratios"] is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < n_layers:
            raise ConfigError(
                f"compress_ratios: expected a list of at least num_hidden_layers={n_layers} integers, got {ratios!r}"
            )
        types = []
        hca_seen: set[int] = set()
        for i, ratio in enumerate(ratios[:n_layers]):
            if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 0 or ratio == 1:
                raise ConfigError(
                    f"compress_ratios[{i}]: expected 0, 4 (CSA) or another ratio > 1 (HCA), got {ratio!r}"
                )
            if ratio == 0:
                types.append(SLIDING)
            elif ratio == 4:  # the official code gives ratio-4 layers the overlap and the indexer
                types.append(CSA)
            else:
                types.append(HCA)
                hca_seen.add(ratio)
        if len(hca_seen) > 1:
            raise ConfigError(f"compress_ratios: expected one HCA ratio, got {sorted(hca_seen)}")
        return tuple(types), 4, hca_seen.pop() if hca_seen else hca_rate
    raise ConfigError("layer_types: missing (neither 'layer_types' nor 'compress_ratios' is in config.json)")


def _mlp_pattern(raw: dict[str, Any], n_layers: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = raw["mlp_layer_types"]
        if not isinstance(types, list) or len(types) < n_layers:
            raise ConfigError(f"mlp_layer_types: expected a list of {n_layers} entries, got {types!r}")
        bad = [t for t in types[:n_layers] if t not in MLP_TYPES]
        if bad:
            raise ConfigError(f"mlp_layer_types: expected entries from {list(MLP_TYPES)}, got {bad}")
        return tuple(types[:n_layers])
    if "num_hash_layers" not in raw:  # every released config names it; the count differs between models
        raise ConfigError(
            "num_hash_layers: missing (neither 'mlp_layer_types' nor 'num_hash_layers' is in config.json)"
        )
    n_hash = raw["num_hash_layers"]
    if isinstance(n_hash, bool) or not isinstance(n_hash, int) or not 0 <= n_hash <= n_layers:
        raise ConfigError(f"num_hash_layers: expected an integer in [0, {n_layers}], got {n_hash!r}")
    return tuple(["hash_moe"] * n_hash + ["moe"] * (n_layers - n_hash))


def _yarn_from(d: dict[str, Any], where: str) -> dict[str, Any]:
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise ConfigError(f"{where}.rope_type: expected 'yarn' or 'default', got {kind!r}")
    if kind == "default":
        return {}
    try:
        return {
            "yarn_factor": float(d["factor"]),
            "original_max_position": int(d["original_max_position_embeddings"]),
            "beta_fast": float(d.get("beta_fast") or 32),
            "beta_slow": float(d.get("beta_slow") or 1),
        }
    except KeyError as exc:
        raise ConfigError(f"{where}.{exc.args[0]}: missing (required for YaRN)") from exc


def _rope_specs(raw: dict[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    params = raw.get("rope_parameters")
    if (
        isinstance(params, dict)
        and isinstance(params.get("main"), dict)
        and isinstance(params.get("compress"), dict)
    ):
        main, comp = params["main"], params["compress"]
        if "rope_theta" not in main or "rope_theta" not in comp:
            raise ConfigError("rope_parameters.main/compress.rope_theta: missing")
        return (
            RopeSpec(float(main["rope_theta"]), **_yarn_from(main, "rope_parameters.main")),
            RopeSpec(float(comp["rope_theta"]), **_yarn_from(comp, "rope_parameters.compress")),
        )
    scaling = raw.get("rope_scaling") or (params if isinstance(params, dict) else None) or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling: expected an object, got {scaling!r}")
    theta = float(raw.get("rope_theta", 10000.0))
    comp_theta = float(raw.get("compress_rope_theta", 160000.0))
    return RopeSpec(theta), RopeSpec(comp_theta, **_yarn_from(scaling, "rope_scaling"))


def _eos(raw: dict[str, Any]) -> int:
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list) and eos:
        eos = eos[0]
    if isinstance(eos, bool) or not isinstance(eos, int):
        raise ConfigError(f"eos_token_id: expected an integer, got {eos!r}")
    return eos


def _quant(raw: dict[str, Any]) -> QuantSpec:
    q = raw.get("quantization_config")
    expert_dtype = raw.get("expert_dtype")
    if q is None:
        return QuantSpec(None, expert_dtype or "bf16")
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config: expected an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method: expected 'fp8', got {method!r}")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size: expected [rows, cols], got {block!r}")
    expert_dtype = expert_dtype or q.get("expert_dtype") or "fp8"
    if expert_dtype not in ("fp8", "fp4", "bf16"):
        raise ConfigError(f"expert_dtype: expected 'fp8', 'fp4' or 'bf16', got {expert_dtype!r}")
    return QuantSpec((block[0], block[1]), expert_dtype)


def _quant_dict(q: QuantSpec) -> dict[str, Any]:
    if q.fp8_block is None:
        return {}
    return {
        "expert_dtype": q.expert_dtype,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": list(q.fp8_block),
        },
    }


def _dspark(raw: dict[str, Any]) -> DSparkSpec | None:
    if "dspark_block_size" not in raw:
        return None
    try:
        return DSparkSpec(
            block_size=int(raw["dspark_block_size"]),
            noise_token_id=int(raw["dspark_noise_token_id"]),
            target_layer_ids=tuple(int(i) for i in raw["dspark_target_layer_ids"]),
            markov_rank=int(raw["dspark_markov_rank"]),
        )
    except KeyError as exc:
        raise ConfigError(f"{exc.args[0]}: missing (required when dspark_block_size is set)") from exc


def _dspark_dict(d: DSparkSpec) -> dict[str, Any]:
    return {
        "dspark_block_size": d.block_size,
        "dspark_noise_token_id": d.noise_token_id,
        "dspark_target_layer_ids": list(d.target_layer_ids),
        "dspark_markov_rank": d.markov_rank,
    }


def _yarn_dict(r: RopeSpec) -> dict[str, Any]:
    return {
        "type": "yarn",
        "factor": r.yarn_factor,
        "original_max_position_embeddings": r.original_max_position,
        "beta_fast": r.beta_fast,
        "beta_slow": r.beta_slow,
    }
