"""The MTP (next-n) draft block of DeepSeek-V4: ``mtp.K.*``.

Row ``i`` combines the target's streams ``H_i`` (after the last layer, before ``hc_head``) with
the embedding of the next token ``t(i+1)``: ``h_proj(hnorm(H_i)) + e_proj(enorm(emb(t(i+1))))``
(the embedding term broadcast over the streams), then one sliding-window decoder block with its
own window state, then its own ``hc_head`` and norm and the target's shared head, giving logits
for ``t(i+2)``. The block's output streams ``G_i`` stand in for ``H`` when drafting further.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SLIDING, ModelConfig
from ..kernels.regions import region
from ..quant import Weight
from ..state import LayerDelta, LayerState
from ..weights import Checkpoint
from .attention import ChunkInfo
from .deepseek4 import BlockWeights, DeepSeekV4, HeadWeights, block_forward, head_logits, load_block
from .linear import linear
from .norms import rms_norm
from .rope import Rope


@dataclass
class MTPWeights:
    e_proj: Weight  # [D, D]
    h_proj: Weight  # [D, D]
    enorm: torch.Tensor  # [D] fp32
    hnorm: torch.Tensor  # [D] fp32
    block: BlockWeights  # sliding-window attention, score-routed MoE
    hc_fn: torch.Tensor  # [hc, hc*D] fp32: the block's own final merge
    hc_base: torch.Tensor
    hc_scale: torch.Tensor
    norm: torch.Tensor  # [D] fp32


def mtp_names(index: int) -> list[str]:
    """The MTP-specific tensor names of block ``index`` (the decoder block's own names excluded)."""
    p = f"mtp.{index}."
    return [
        p + n
        for n in (
            "e_proj.weight",
            "h_proj.weight",
            "enorm.weight",
            "hnorm.weight",
            "norm.weight",
            "hc_head_fn",
            "hc_head_base",
            "hc_head_scale",
        )
    ]


def load_mtp(ckpt: Checkpoint, index: int, dtype: torch.dtype, device: torch.device) -> MTPWeights:
    p = f"mtp.{index}."

    def f32(name: str) -> torch.Tensor:
        return ckpt.dense(p + name, torch.float32, device)

    return MTPWeights(
        e_proj=ckpt.dense(p + "e_proj.weight", dtype, device),
        h_proj=ckpt.dense(p + "h_proj.weight", dtype, device),
        enorm=f32("enorm.weight"),
        hnorm=f32("hnorm.weight"),
        block=load_block(ckpt, f"mtp.{index}", SLIDING, False, dtype, device),
        hc_fn=f32("hc_head_fn"),
        hc_base=f32("hc_head_base"),
        hc_scale=f32("hc_head_scale"),
        norm=f32("norm.weight"),
    )


def mtp_forward(
    w: MTPWeights,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    embedded: torch.Tensor,
    chunk: ChunkInfo,
    ls: LayerState,
    cfg: ModelConfig,
    ropes: dict[str, Rope],
) -> tuple[torch.Tensor, LayerDelta]:
    """Output streams ``[S, hc, D]`` for rows ``(hidden [S, hc, D], next_ids [S])`` and the rows to commit;
    ``embedded [S, D]`` holds the target's embedding rows of ``next_ids`` on ``hidden``'s device (the
    caller looks them up: the table may live on another device, outside a captured pass)."""
    eps = cfg.rms_norm_eps
    e = linear(rms_norm(embedded, w.enorm, eps), w.e_proj)
    h = linear(rms_norm(hidden.to(e.dtype), w.hnorm, eps), w.h_proj)
    streams, delta, _ = block_forward(w.block, h + e.unsqueeze(1), chunk, ls, next_ids, cfg, ropes)
    return streams, delta


def mtp_logits(w: MTPWeights, streams: torch.Tensor, head: HeadWeights, cfg: ModelConfig) -> torch.Tensor:
    """float32 logits ``[N, V]`` of output streams ``[N, hc, D]`` through the block's own merge and norm and
    the target's shared head (``head``: the target's)."""
    return head_logits(HeadWeights(w.hc_fn, w.hc_base, w.hc_scale, w.norm, head.head, head.ids), streams, cfg)


@region
def static_pass(
    w: MTPWeights,
    target: DeepSeekV4,
    head: HeadWeights,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    embedded: torch.Tensor,
    positions: torch.Tensor,
    ls: LayerState,
) -> tuple[torch.Tensor, LayerDelta, torch.Tensor]:
    """A static pass at device ``positions`` (a captured draft pass): :func:`mtp_forward`'s streams and delta and
    the last row's :func:`mtp_logits` ``[1, V]``, the RoPE tables at ``positions`` included, as one compiled
    region, so that the pass's small ops (tables, input norms, the head's merge) fuse around the block's.
    ``target``: the model part whose RoPE tables and configuration the pass uses (it holds the head)."""
    chunk = target.chunk_info(0, next_ids.shape[0], positions)
    G, delta = mtp_forward(w, hidden, next_ids, embedded, chunk, ls, target.cfg, target.ropes)
    return G, delta, mtp_logits(w, G[-1:], head, target.cfg)
