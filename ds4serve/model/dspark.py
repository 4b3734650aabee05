"""The DSpark draft of DeepSeek-V4: three decoder stages (``mtp.0-2``) that draft a whole block.

* Context: for each committed position, the target's streams after the configured layers,
  averaged over the hc streams and concatenated, go through ``main_proj`` and ``main_norm``
  (stage 0) to ``main_x``; every stage projects the same ``main_x`` with its own ``wkv`` and
  ``kv_norm`` into a ring of ``sliding_window`` context rows (RoPE at the row's position).
* Block: ``[seed, noise x (block_size - 1)]`` at the positions after the last committed one; its
  queries attend to every valid context row and to every block row (bidirectional, with the
  learned sink), stage after stage with the usual mHC and score-routed MoE.
* Output: the last stage's ``hc_head`` merge ``h`` (before the norm), the target's head on
  ``norm(h)`` for the base logits, then the Markov head sequentially (``W2 W1[prev]`` added for
  the previous token) and the confidence head ``sigmoid(w . [h ; W1[prev]])``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SLIDING, DSparkSpec, ModelConfig
from ..quant import Weight
from ..weights import Checkpoint
from .attention import AttentionWeights, _core
from .deepseek4 import BlockWeights, HeadWeights, load_block, vocab_logits
from .hyper import hc_head, hc_merge, hc_merge_pre, hc_pre
from .linear import grouped_linear, linear
from .moe import moe
from .norms import rms_norm, unweighted_rms_norm
from .rope import Rope

DSPARK_STAGES = 3


@dataclass
class DSparkWeights:
    spec: DSparkSpec
    stages: list[BlockWeights]
    main_proj: Weight  # [D, len(target_layer_ids) * D]
    main_norm: torch.Tensor  # [D] fp32
    hc_fn: torch.Tensor  # [hc, hc*D] fp32: the last stage's final merge
    hc_base: torch.Tensor
    hc_scale: torch.Tensor
    norm: torch.Tensor  # [D] fp32
    markov_w1: torch.Tensor  # [V, r]: embedding of the previous token
    markov_w2: torch.Tensor  # [V, r]: projection r -> V
    confidence: torch.Tensor  # [1, D + r]


def load_dspark(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> DSparkWeights:
    """Load the stages and heads (shapes are checked by ``engine.dspark_weights.check_dspark``)."""
    spec = ckpt.cfg.dspark
    last = f"mtp.{DSPARK_STAGES - 1}."

    def f32(name: str) -> torch.Tensor:
        return ckpt.dense(name, torch.float32, device)

    return DSparkWeights(
        spec=spec,
        stages=[load_block(ckpt, f"mtp.{s}", SLIDING, False, dtype, device) for s in range(DSPARK_STAGES)],
        main_proj=ckpt.dense("mtp.0.main_proj.weight", dtype, device),
        main_norm=f32("mtp.0.main_norm.weight"),
        hc_fn=f32(last + "hc_head_fn"),
        hc_base=f32(last + "hc_head_base"),
        hc_scale=f32(last + "hc_head_scale"),
        norm=f32(last + "norm.weight"),
        markov_w1=f32(last + "markov_head.markov_w1.weight"),
        markov_w2=f32(last + "markov_head.markov_w2.weight"),
        confidence=f32(last + "confidence_head.proj.weight"),
    )


def target_features(captured: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """``[n, len(layers) * D]``: the stream means of the captured target layers, in config order."""
    return torch.cat([captured[layer].mean(dim=1) for layer in layers], dim=-1)


def context_rows(
    w: DSparkWeights, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: ModelConfig
) -> list[torch.Tensor]:
    """Per stage, the context K=V rows ``[n, head_dim]`` of ``features`` at positions with ``cos``/``sin``."""
    eps = cfg.rms_norm_eps
    main_x = rms_norm(linear(features.to(w.main_norm.device), w.main_proj), w.main_norm, eps)
    return [Rope.apply(rms_norm(linear(main_x, s.attn.wkv), s.attn.kv_norm, eps), cos, sin) for s in w.stages]


def block_merged(
    w: DSparkWeights,
    ids: torch.Tensor,
    embedded: torch.Tensor,
    context: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: ModelConfig,
    context_allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The last stage's merged streams ``h [B, D]`` (before the norm) for block ``ids [B]``, whose
    embedding rows are ``embedded [B, D]`` (on ``ids``' device).

    ``context_allowed [1, C]`` marks the context rows to attend (a static pass reads each stage's
    whole ring; see :func:`ring_context`); None: all of them."""
    X = embedded.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for stage, ctx in zip(w.stages, context):
        X = _stage(stage, X, ids, ctx, cos, sin, cfg, context_allowed)
    return hc_head(X, w.hc_fn, w.hc_base, w.hc_scale, cfg.hc_eps, cfg.rms_norm_eps)


def base_logits(w: DSparkWeights, merged: torch.Tensor, head: HeadWeights, cfg: ModelConfig) -> torch.Tensor:
    """float32 ``[B, V]``: the target's head on ``norm(h)``."""
    return vocab_logits(rms_norm(merged, w.norm, cfg.rms_norm_eps), head, cfg)


def markov_bias(w: DSparkWeights, prev: int) -> torch.Tensor:
    """``W2 W1[prev]`` ``[V]``: the low-rank transition bias after token ``prev``."""
    return w.markov_w2 @ w.markov_w1[prev]


def confidence(w: DSparkWeights, merged: torch.Tensor, prev: int) -> float:
    """P(this slot's draft is accepted | the earlier ones were), from ``h [D]`` and ``W1[prev]``."""
    feats = torch.cat([merged.float(), w.markov_w1[prev]])
    return float(torch.sigmoid(w.confidence[0] @ feats))


def ring_context(ring: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[1, W]``: the ring slots that hold a committed position before device position ``pos [1]``."""
    last = pos - 1
    slots = torch.arange(ring.shape[0], device=ring.device)
    return (last - (last - slots) % ring.shape[0] >= 0).unsqueeze(0)


def _stage(
    b: BlockWeights,
    X: torch.Tensor,
    ids: torch.Tensor,
    ctx: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: ModelConfig,
    ctx_allowed: torch.Tensor | None,
) -> torch.Tensor:
    """One stage: the decoder block with block attention in place of causal window attention."""
    hc, iters, eps, neps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    post, comb, x = hc_pre(X, b.hc_attn, b.attn_norm, hc, iters, eps, neps)
    a = _block_attention(b.attn, x, ctx, cos, sin, cfg, ctx_allowed)
    X, post, comb, x = hc_merge_pre(X, a, post, comb, b.hc_ffn, b.ffn_norm, hc, iters, eps, neps)
    m = moe(b.moe, x, ids, cfg.top_k, cfg.routed_scaling_factor, cfg.swiglu_limit)
    return hc_merge(X, m, post, comb)


def _block_attention(
    w: AttentionWeights,
    x: torch.Tensor,
    ctx: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: ModelConfig,
    ctx_allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Every block query over every (allowed) context row and every block row, with the per-head sink."""
    B, H, hd, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    q_res = rms_norm(linear(x, w.wq_a), w.q_norm, eps)
    q = Rope.apply(unweighted_rms_norm(linear(q_res, w.wq_b).view(B, H, hd), eps), cos, sin)
    kv = Rope.apply(rms_norm(linear(x, w.wkv), w.kv_norm, eps), cos, sin)
    keys = torch.cat([ctx, kv])
    allowed = torch.ones(B, keys.shape[0], dtype=torch.bool, device=x.device)
    if ctx_allowed is not None:
        allowed[:, : ctx.shape[0]] = ctx_allowed
    out = Rope.apply(_core(q, keys, allowed, w.sinks, hd**-0.5), cos, sin, inverse=True)
    low = grouped_linear(out.reshape(B, cfg.o_groups, -1), w.wo_a, cfg.o_groups)
    return linear(low, w.wo_b)
