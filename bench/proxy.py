"""The proxy model: DeepSeek-V4-Flash shapes at full depth, 32 routed experts, random weights
made directly on the GPU (bf16, FP8, or FP8 with MXFP4 routed experts).

Batch-1 decode reads exactly the real model's bytes per token (6 routed + 1 shared expert per
layer); the whole bf16 model (about 84 GB) fits one H200.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ds4serve.config import CSA, HCA, SLIDING, ModelConfig, QuantSpec, RopeSpec
from ds4serve.model import DeepSeekV4
from ds4serve.model.attention import AttentionWeights, IndexerWeights, concatenate_projections
from ds4serve.model.compressor import CompressorWeights
from ds4serve.model.deepseek4 import BlockWeights, HeadWeights
from ds4serve.model.hyper import HCSite
from ds4serve.model.moe import MoEWeights
from ds4serve.model.mtp import MTPWeights
from ds4serve.quant import FP4Weight, FP8Weight, Weight

VARIANTS = ("bf16", "fp8", "fp8+fp4")
BLOCK = (128, 128)


def flash_config(layers: int = 43, experts: int = 32, variant: str = "bf16") -> ModelConfig:
    """DeepSeek-V4-Flash dims and layer pattern (first ``layers`` layers), ``experts`` routed experts."""
    types = tuple(SLIDING if i < 2 else (CSA if i % 2 == 0 else HCA) for i in range(layers))
    quant = QuantSpec() if variant == "bf16" else QuantSpec(BLOCK, "fp4" if variant == "fp8+fp4" else "fp8")
    return ModelConfig(
        vocab_size=129280,
        hidden_size=4096,
        num_layers=layers,
        num_heads=64,
        head_dim=512,
        rope_dim=64,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        moe_inter=2048,
        n_routed_experts=experts,
        n_shared_experts=1,
        top_k=6,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        sliding_window=128,
        layer_types=types,
        mlp_types=tuple(["hash_moe"] * min(3, layers) + ["moe"] * max(0, layers - 3)),
        csa_rate=4,
        hca_rate=128,
        rope_main=RopeSpec(10000.0),
        rope_compress=RopeSpec(160000.0, yarn_factor=16.0, original_max_position=65536),
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        max_position_embeddings=1048576,
        quant=quant,
    )


class _Maker:
    """Random weights for ``cfg`` on ``device``; FP8 scale blocks follow ``cfg.quant`` (128x128 for
    :func:`flash_config`, smaller for the tiny configs of ``ds4serve.tiny``)."""

    def __init__(self, cfg: ModelConfig, variant: str, device: torch.device, seed: int):
        self.cfg, self.variant, self.device = cfg, variant, device
        self.fp8_block = cfg.quant.fp8_block or BLOCK
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype)

    def dense(self, *shape: int) -> torch.Tensor:
        return self.randn(*shape).mul_(1 / math.sqrt(shape[-1]))

    def f32(self, *shape: int, mean: float = 0.0, std: float = 0.1) -> torch.Tensor:
        return self.randn(*shape, dtype=torch.float32).mul_(std).add_(mean)

    def proj(self, *shape: int, fp8: bool) -> Weight:
        """A projection (``[out, in]`` or stacked ``[E, out, in]``), FP8 when asked."""
        if not fp8:
            return self.dense(*shape)
        data = self.randn(*shape).mul_(16).to(torch.float8_e4m3fn)
        blocks = (*shape[:-2], -(-shape[-2] // self.fp8_block[0]), -(-shape[-1] // self.fp8_block[1]))
        scale = torch.full(
            blocks, 2.0 ** round(math.log2(1 / (16 * math.sqrt(shape[-1])))), device=self.device
        )
        return FP8Weight(data, scale, self.fp8_block)

    def fp4(self, *shape: int) -> FP4Weight:
        """Random MXFP4 codes; e2m1 codes drawn uniformly have an RMS of about 2.9."""
        *lead, rows, cols = shape
        data = torch.randint(
            -128, 128, (*lead, rows, cols // 2), generator=self.gen, device=self.device, dtype=torch.int8
        )
        exp = 127 + round(math.log2(1 / (2.9 * math.sqrt(cols))))
        return FP4Weight(
            data, torch.full((*lead, rows, cols // 32), exp, dtype=torch.uint8, device=self.device)
        )

    def compressor(self, width: int, dim: int, rate: int) -> CompressorWeights:
        D = self.cfg.hidden_size
        return CompressorWeights(
            wkv=self.dense(width, D),
            wgate=self.dense(width, D),
            ape=self.f32(rate, width, std=0.5),
            norm=self.f32(dim, mean=1.0),
        )

    def block(self, layer: int | None) -> BlockWeights:
        """Layer ``layer``'s block; None: an MTP block (sliding window, score-routed)."""
        c = self.cfg
        D, H, hd, q, hc = c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank, c.hc_mult
        fp8 = self.variant != "bf16"
        kind = SLIDING if layer is None else c.layer_types[layer]
        attn = AttentionWeights(
            layer_type=kind,
            wq_a=self.proj(q, D, fp8=fp8),
            q_norm=self.f32(q, mean=1.0),
            wq_b=self.proj(H * hd, q, fp8=fp8),
            wkv=self.proj(hd, D, fp8=fp8),
            kv_norm=self.f32(hd, mean=1.0),
            wo_a=self.proj(c.o_groups * c.o_lora_rank, H * hd // c.o_groups, fp8=fp8),
            wo_b=self.proj(D, c.o_groups * c.o_lora_rank, fp8=fp8),
            sinks=self.f32(H, std=0.5),
        )
        if kind != SLIDING:
            overlap = kind == CSA
            attn.compressor = self.compressor(
                2 * hd if overlap else hd, hd, c.csa_rate if overlap else c.hca_rate
            )
        if kind == CSA:
            ih, ihd = c.index_n_heads, c.index_head_dim
            attn.indexer = IndexerWeights(
                wq_b=self.proj(ih * ihd, q, fp8=fp8),
                weights_proj=self.dense(ih, D),
                compressor=self.compressor(2 * ihd, ihd, c.csa_rate),
            )
        concatenate_projections(attn)
        E, inter = c.n_routed_experts, c.moe_inter
        hashed = layer is not None and c.is_hash_layer(layer)
        if self.variant == "fp8+fp4":
            w1, w3, w2 = self.fp4(E, inter, D), self.fp4(E, inter, D), self.fp4(E, D, inter)
        else:
            w1, w3, w2 = (
                self.proj(E, inter, D, fp8=fp8),
                self.proj(E, inter, D, fp8=fp8),
                self.proj(E, D, inter, fp8=fp8),
            )
        tid2eid = None
        if hashed:
            tid2eid = torch.rand(c.vocab_size, E, generator=self.gen, device=self.device).argsort(-1)[
                :, : c.top_k
            ]
        moe = MoEWeights(
            gate=self.dense(E, D),
            bias=None if hashed else self.f32(E),
            tid2eid=tid2eid,
            w1=w1,
            w3=w3,
            w2=w2,
            shared_w1=self.proj(inter, D, fp8=fp8),
            shared_w3=self.proj(inter, D, fp8=fp8),
            shared_w2=self.proj(D, inter, fp8=fp8),
        )
        mix = (2 + hc) * hc
        site = lambda: HCSite(
            self.f32(mix, hc * D, std=0.5 / math.sqrt(hc * D)),
            self.f32(mix),  # noqa: E731
            self.f32(3, mean=1.0),
        )
        return BlockWeights(
            attn_norm=self.f32(D, mean=1.0),
            ffn_norm=self.f32(D, mean=1.0),
            hc_attn=site(),
            hc_ffn=site(),
            attn=attn,
            moe=moe,
        )

    def mtp(self) -> MTPWeights:
        """An MTP draft block (its projections dense, as the official checkpoint stores them)."""
        D, hc = self.cfg.hidden_size, self.cfg.hc_mult
        return MTPWeights(
            e_proj=self.dense(D, D),
            h_proj=self.dense(D, D),
            enorm=self.f32(D, mean=1.0),
            hnorm=self.f32(D, mean=1.0),
            block=self.block(None),
            hc_fn=self.f32(hc, hc * D, std=0.5 / math.sqrt(hc * D)),
            hc_base=self.f32(hc),
            hc_scale=self.f32(1, mean=1.0),
            norm=self.f32(D, mean=1.0),
        )

    def head(self) -> HeadWeights:
        D, hc = self.cfg.hidden_size, self.cfg.hc_mult
        return HeadWeights(
            hc_fn=self.f32(hc, hc * D, std=0.5 / math.sqrt(hc * D)),
            hc_base=self.f32(hc),
            hc_scale=self.f32(1, mean=1.0),
            norm=self.f32(D, mean=1.0),
            head=self.dense(self.cfg.vocab_size, D),
        )


def build_proxy(
    variant: str = "bf16", layers: int = 43, experts: int = 32, device: str = "cuda", seed: int = 0
) -> DeepSeekV4:
    """The proxy model with random weights created on ``device``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    cfg = flash_config(layers, experts, variant)
    dev = torch.device(device)
    mk = _Maker(cfg, variant, dev, seed)
    blocks = {i: mk.block(i) for i in range(layers)}
    head = mk.head()  # before the embedding: the generator's order, so the weights stay the same
    embed = mk.randn(cfg.vocab_size, cfg.hidden_size)
    return DeepSeekV4(cfg, range(layers), blocks, embed, head, torch.bfloat16, dev)


def bytes_per_token(model: DeepSeekV4) -> int:
    """Weight bytes a batch-1 decode step reads: everything but the embedding table and hash tables,
    and only ``top_k`` of the routed experts in each layer. For a shard of a split model, the head
    and the one embedding row count only where the shard holds them (the shards' figures add up)."""
    return _per_token(model, lambda ts: sum(t.numel() * t.element_size() for t in ts))


def params_per_token(model: DeepSeekV4) -> int:
    """The weights :func:`bytes_per_token` reads, counted as parameters (an MXFP4 byte holds two; scale
    tensors count too, as they are read): the matmul work per token, whatever the storage."""
    return _per_token(model, lambda ts: sum(t.numel() * (2 if t.dtype == torch.int8 else 1) for t in ts))


def _per_token(model: DeepSeekV4, size) -> int:
    from ds4serve.model.deepseek4 import _tensors_of

    cfg = model.cfg
    total = 0
    if model.head is not None:
        total += size(_tensors_of(model.head))
    if model.embed is not None:
        total += size([model.embed[0]])
    for b in model.blocks.values():
        m = b.moe
        routed = size(_tensors_of(m.w1) + _tensors_of(m.w3) + _tensors_of(m.w2))
        rest = dataclasses.replace(m, w1=None, w3=None, w2=None, tid2eid=None)
        total += routed * cfg.top_k // cfg.n_routed_experts + size(_tensors_of(rest))
        total += size(_tensors_of(dataclasses.replace(b, moe=None)))
    return total
