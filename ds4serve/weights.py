"""Loading a directory of safetensors shards in the official or the transformers layout.

Everything inside ds4serve uses the *official* tensor names (``layers.L.attn.wq_a.weight``...).
Other layouts are read through :func:`official_name`: transformers' in-memory names (whose stacked
``gate_up_proj`` / ``down_proj`` expert tensors are viewed per expert) and what transformers'
``save_pretrained`` writes, so every layout produces the same tensors. Routed experts are
recognised in the trunk (``layers.L``) and in the draft blocks (``mtp.K``, MTP and DSpark) alike.
The vision release's image-only tensors are recognised and left unloaded.

Names, shapes and dtypes come from the shards' headers (:func:`read_header`); tensors are
memory-mapped by safetensors and read one at a time. :meth:`Checkpoint.dense` dequantizes FP8 /
MXFP4 exactly; :meth:`Checkpoint.raw` hands out the stored tensors so that GPU kernels can keep
them quantized.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import CSA, SLIDING, ModelConfig
from .quant import FP4_BLOCK, dequant_fp4, dequant_fp8

log = logging.getLogger(__name__)


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
# transformers' names (in memory, and as ``save_pretrained`` writes some of them) -> official names
_BLOCK_ALIASES = {
    **{v: k for k, v in _LAYER_NAMES.items()},
    "attn.norm.weight": "attn.kv_norm.weight",
    "self_attn.norm.weight": "attn.kv_norm.weight",
    "self_attn.compressor.norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.norm.weight": "attn.indexer.compressor.norm.weight",
}
_TOP_ALIASES = {v.removeprefix("model."): k for k, v in _TOP_NAMES.items()}
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


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a shard's header describes it (nothing of its data is read)."""

    shard: Path
    key: str
    dtype: str  # the safetensors dtype name: "BF16", "F8_E4M3", "F8_E8M0", "I8", ...
    shape: tuple[int, ...]
    nbytes: int


_MAX_HEADER = 100 << 20


def read_header(shard: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, from its header alone (the first 8 + N bytes)."""
    try:
        with open(shard, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= _MAX_HEADER:
                raise CheckpointError(f"{shard.name}: not a safetensors file (header length {size})")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise CheckpointError(f"{shard.name}: named in the index but missing on disk") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{shard.name}: the safetensors header is not valid JSON ({exc})") from exc
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, stop = info["data_offsets"]
        out[key] = StoredTensor(shard, key, info["dtype"], tuple(info["shape"]), stop - begin)
    return out


@dataclass
class _Source:
    """Where one logical tensor lives: a stored tensor, optionally a slice of it."""

    stored: StoredTensor
    index: tuple | None = None  # a slice of the stored tensor (stacked transformers experts)


# The tensors of DeepSeek-V4-Flash-Vision-Exp that only images use: recognised, reported, not loaded.
_VISION_RE = re.compile(r"^(?:vision\.|aligner\.|image_)|\.(?:ffn|mlp)\.gate\.bias_vl$")
_STACKED_RE = re.compile(r"^((?:layers|mtp)\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def official_name(key: str) -> str:
    """The official name of a stored tensor name in any layout: official, transformers' in-memory
    names, or what transformers' ``save_pretrained`` writes (``model.``-prefixed official names with
    some names kept in memory form, and the attention ``kv_norm`` saved as ``norm``). A name no layout
    knows comes back unchanged (stacked experts are mapped by :class:`Checkpoint`)."""
    name = key.removeprefix("model.")
    if name.endswith(".weight_scale_inv"):  # transformers' name of an FP8 block scale
        return official_name(name.removesuffix("_scale_inv")).removesuffix(".weight") + ".scale"
    if name in _TOP_ALIASES:
        return _TOP_ALIASES[name]
    m = re.match(r"^((?:layers|mtp)\.\d+)\.(.+)$", name)
    if m and m.group(2) in _BLOCK_ALIASES:
        return f"{m.group(1)}.{_BLOCK_ALIASES[m.group(2)]}"
    return name


class Checkpoint:
    """A checkpoint directory opened lazily; tensors are addressed by their official names.

    Names, shapes and dtypes come from the shards' headers; a tensor's data is read (memory-mapped)
    only by :meth:`raw` and what builds on it. Tensors of the vision release that text does not use
    are listed in :attr:`ignored` and logged once."""

    def __init__(self, path: str | Path, cfg: ModelConfig | None = None):
        self.path = Path(path)
        self.cfg = cfg if cfg is not None else ModelConfig.from_dir(self.path)
        self._handles: dict[Path, object] = {}
        self.stored: dict[str, StoredTensor] = self._scan()
        self.sources: dict[str, _Source] = {}
        self.ignored: list[str] = []
        self._duplicates: list[str] = []
        renamed = False
        for key, st in self.stored.items():
            renamed |= self._add_source(key, st)
        self.layout = "transformers" if renamed else "official"
        if self.ignored:
            log.info(
                "%s: %d tensors of the vision release (vision.*, aligner.*, image_*, ffn.gate.bias_vl) "
                "are not loaded: text only",
                self.path,
                len(self.ignored),
            )
        self._validate()

    # ---- discovery -----------------------------------------------------------------------------
    def _scan(self) -> dict[str, StoredTensor]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(
                    f"{index.name}: expected a JSON object with 'weight_map' ({exc})"
                ) from exc
            headers = {f: read_header(self.path / f) for f in sorted(set(weight_map.values()))}
            missing = [k for k, f in weight_map.items() if k not in headers[f]]
            if missing:
                raise CheckpointError(
                    f"{index.name}: {len(missing)} tensor(s) are not in the shard the index names, "
                    f"e.g. {missing[0]} in {weight_map[missing[0]]}"
                )
            return {k: headers[f][k] for k, f in weight_map.items()}
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        return {k: st for shard in shards for k, st in read_header(shard).items()}

    def _add_source(self, key: str, st: StoredTensor) -> bool:
        """Record where stored tensor ``key`` lives under its official name(s); True if renamed."""
        name = official_name(key)
        if _VISION_RE.search(name):
            self.ignored.append(key)
            return name != key
        stacked = _STACKED_RE.match(name)
        if stacked:
            prefix, inter = stacked.group(1), self.cfg.moe_inter
            for e in range(st.shape[0]):
                p = f"{prefix}.ffn.experts.{e}"
                if stacked.group(2) == "gate_up_proj":
                    self._put(f"{p}.w1.weight", _Source(st, (e, slice(0, inter))))
                    self._put(f"{p}.w3.weight", _Source(st, (e, slice(inter, 2 * inter))))
                else:
                    self._put(f"{p}.w2.weight", _Source(st, (e,)))
            return True
        self._put(name, _Source(st))
        return name != key

    def _put(self, name: str, src: _Source) -> None:
        if name in self.sources:
            self._duplicates.append(
                f"tensor {name} is stored twice ({self.sources[name].stored.key}, {src.stored.key})"
            )
        self.sources[name] = src

    def _handle(self, shard: Path):
        """The shard opened for reading its tensors; CheckpointError naming it when its data is not all there (the
        headers, all that inspecting needs, may be)."""
        if shard not in self._handles:
            try:
                self._handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error type, not an OSError
                raise CheckpointError(
                    f"{shard.name}: cannot read its tensors, truncated or damaged ({exc})"
                ) from None
        return self._handles[shard]

    # ---- validation ----------------------------------------------------------------------------
    def stored_shape(self, name: str) -> tuple[int, ...]:
        src = self.sources[name]
        shape = list(src.stored.shape)
        if src.index is not None:
            for i, idx in enumerate(src.index):
                shape[i] = -1 if isinstance(idx, int) else len(range(*idx.indices(shape[i])))
            shape = [d for d in shape if d != -1]
        return tuple(shape)

    def stored_dtype(self, name: str) -> str:
        """The safetensors dtype name of tensor ``name`` (from its shard's header)."""
        return self.sources[name].stored.dtype

    def _logical_shape(self, name: str) -> tuple[int, ...]:
        shape = self.stored_shape(name)
        if _EXPERT_RE.match(name) and self.stored_dtype(name) in ("I8", "U8"):
            return (*shape[:-1], shape[-1] * 2)  # MXFP4: two codes per byte
        return shape

    def _validate(self) -> None:
        expected = expected_shapes(self.cfg)
        problems: list[str] = list(self._duplicates)
        for name, shape in expected.items():
            if name not in self.sources:
                problems.append(f"missing tensor {name} (expected shape {list(shape)})")
                continue
            actual = self._logical_shape(name)
            if actual != shape:
                problems.append(f"tensor {name}: expected shape {list(shape)}, got {list(actual)}")
            quant = self.storage_format(name)
            if quant is not None and _scale_name(name) not in self.sources:
                problems.append(f"tensor {name} is {quant.upper()} but {_scale_name(name)} is missing")
        for name in self.sources:
            if name in expected or name.endswith(".scale") or name.startswith("mtp."):
                continue
            problems.append(f"unexpected tensor {name} (shape {list(self.stored_shape(name))})")
        if problems:
            head = f"{self.path}: checkpoint does not match its config.json ({len(problems)} problem(s)):\n  "
            more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
            raise CheckpointError(head + "\n  ".join(problems[:50]) + more)

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
        handle = self._handle(src.stored.shard)
        if src.index is None:
            return handle.get_tensor(src.stored.key)
        return handle.get_slice(src.stored.key)[src.index]

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


@dataclass(frozen=True)
class ParameterCounts:
    """Logical parameters of a checkpoint (an MXFP4 byte holds two; block scales and the hash
    routers' ``tid2eid`` tables are not parameters)."""

    main: int  # the trunk: embedding, layers, final merge, norm, head
    drafts: int  # the MTP / DSpark blocks (mtp.*)
    active: int  # what one token's trunk forward uses: all but the routed experts it does not select
    ignored: int  # vision-release tensors that text does not load


def parameter_counts(ckpt: Checkpoint) -> ParameterCounts:
    """Count ``ckpt``'s parameters from its headers alone (no tensor data is read)."""
    main = drafts = routed = 0
    for name in ckpt.names():
        if name.endswith(".scale") or ckpt.stored_dtype(name) in _INTEGER_DTYPES:
            continue
        n = math.prod(ckpt._logical_shape(name))
        if name.startswith("mtp."):
            drafts += n
        else:
            main += n
            routed += n if _EXPERT_RE.match(name) else 0
    cfg = ckpt.cfg
    active = main - routed + routed * cfg.top_k // cfg.n_routed_experts
    ignored = sum(math.prod(ckpt.stored[k].shape) for k in ckpt.ignored)
    return ParameterCounts(main, drafts, active, ignored)


_INTEGER_DTYPES = ("I64", "I32", "I16")


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def _infer_block(weight_shape: torch.Size, scale_shape: torch.Size) -> tuple[int, int]:
    return (-(-weight_shape[0] // scale_shape[0]), -(-weight_shape[1] // scale_shape[1]))


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ParameterCounts",
    "StoredTensor",
    "official_name",
    "parameter_counts",
    "read_header",
    "expected_shapes",
    "block_shapes",
    "official_to_hf",
    "FP8_LAYER_WEIGHTS",
    "FP4_BLOCK",
]
