"""Which weights a decode step's side branches ask L2 for, and where they fork (:mod:`ds4serve.kernels.prefetch`).

A block of a captured decode step has three windows in which HBM idles before projections whose weights are
known in advance; each is a switch:

* ``prefetch_inputs``: forked just before the block's first mHC site (after the previous block's MoE), for
  the input projections (e.g. FP8 ``wq_a``+``wkv`` and the bf16 compressors) and then ``q_res``'s
  (``wq_b``, the indexer's ``wq_b``);
* ``prefetch_output``: forked just after ``q_res``'s product, for ``wo_a`` then ``wo_b``, while the norms,
  RoPE, the compressor, the indexer and the decode attention run;
* ``prefetch_shared``: forked just before the MoE's mHC site, for the router's gate and the shared expert
  (the routed experts are known only once the router has run).

Each plan covers its weights in that order up to the prefetch budget.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.switches import prefetching
from .linear import FP4Weight, FP8Weight, Weight


def install(model, like: torch.Tensor) -> None:
    """Register every block's three forks for ``model`` (a :class:`~ds4serve.model.DeepSeekV4`) when a
    prefetch window is on and the kernels run on tensors like ``like``, outside a capture (plans are
    host-to-device copies); blocks already registered are left as they are."""
    if not (prefetching() and kernels.enabled(like)):
        return
    from ..kernels import prefetch

    if prefetch.capturing(like):
        return
    for b in model.blocks.values():
        if prefetch.registered(b.hc_attn.fn, after=False) is not None:
            continue
        attn, moe = b.attn, b.moe
        if attn.x_proj is not None and attn.q_proj is not None:
            inputs = [g.weight for p in (attn.x_proj, attn.q_proj) for g in p.groups]
            q_last = attn.q_proj.groups[-1].weight
        else:
            inputs = [*attn.input_parts().values(), *attn.q_parts().values()]
            q_last = list(attn.q_parts().values())[-1]
        prefetch.register(b.hc_attn.fn, "inputs", prefetch.plan(storage(inputs)), after=False)
        prefetch.register(_read(q_last), "output", prefetch.plan(storage([attn.wo_a, attn.wo_b])), after=True)
        shared = [moe.gate, moe.shared_w1, moe.shared_w3, moe.shared_w2]
        prefetch.register(b.hc_ffn.fn, "shared", prefetch.plan(storage(shared)), after=False)


def _read(w: Weight) -> torch.Tensor:
    """The tensor a GEMV op receives for ``w`` (its trigger)."""
    return w.data if isinstance(w, (FP8Weight, FP4Weight)) else w


def storage(weights: list[Weight]) -> list[torch.Tensor]:
    """The tensors a product reads for each weight, in order: the data, then any block scales."""
    out: list[torch.Tensor] = []
    for w in weights:
        out.extend((w.data, w.scale) if isinstance(w, (FP8Weight, FP4Weight)) else (w,))
    return out
