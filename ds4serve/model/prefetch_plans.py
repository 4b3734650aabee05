"""Which weights a decoder block's latency-bound launches ask L2 for (``SWITCHES.l2_prefetch``).

A decode step has three windows per block in which HBM idles (:mod:`ds4serve.kernels.prefetch`), each
before projections whose weights are known in advance:

* the block's first mHC site: then the input projections (one or two concatenated weights, e.g. FP8
  ``wq_a``+``wkv`` and the bf16 compressor weights) and ``q_res``'s (``wq_b``, the indexer's ``wq_b``);
* the attention: then ``wo_a`` and ``wo_b``;
* the MoE's mHC site: then the router's gate and the shared expert (the routed experts are known only
  once the router has run).

Each plan covers its weights in that order up to the prefetch budget.
"""

from __future__ import annotations

import torch

from ..kernels import prefetch
from .attention import AttentionWeights
from .linear import FP4Weight, FP8Weight, Weight
from .moe import MoEWeights


class BlockPrefetch:
    """A block's plans (``(address, bytes)`` pieces, :func:`ds4serve.kernels.prefetch.plan`), None where a
    window prefetches nothing. Not a dataclass on purpose: model byte counts walk dataclass fields, and
    plans are not weights."""

    def __init__(self, attn_site: torch.Tensor | None, attention: torch.Tensor | None,
                 moe_site: torch.Tensor | None):
        self.attn_site, self.attention, self.moe_site = attn_site, attention, moe_site


NO_PREFETCH = BlockPrefetch(None, None, None)


def block_prefetch(attn: AttentionWeights, moe: MoEWeights) -> BlockPrefetch:
    """The three plans of a block with these attention and MoE weights."""
    if attn.x_proj is not None and attn.q_proj is not None:
        inputs = [g.weight for p in (attn.x_proj, attn.q_proj) for g in p.groups]
    else:
        inputs = [*attn.input_parts().values(), *attn.q_parts().values()]
    return BlockPrefetch(
        attn_site=prefetch.plan(_storage(inputs)),
        attention=prefetch.plan(_storage([attn.wo_a, attn.wo_b])),
        moe_site=prefetch.plan(_storage([moe.gate, moe.shared_w1, moe.shared_w3, moe.shared_w2])))


def _storage(weights: list[Weight]) -> list[torch.Tensor]:
    """The tensors a product reads for each weight, in order: the data, then any block scales."""
    out: list[torch.Tensor] = []
    for w in weights:
        out.extend((w.data, w.scale) if isinstance(w, (FP8Weight, FP4Weight)) else (w,))
    return out
