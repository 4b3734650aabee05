"""The DSpark draft's tensor contract: names and shapes by official name, and random weights for tiny checkpoints.

Stages ``mtp.0-2`` are full decoder blocks (sliding attention, score-routed MoE). Stage 0 also
holds ``main_proj [D, n_targets*D]`` and ``main_norm``; the last stage holds the final merge
(``hc_head_*``, ``norm``), the Markov head (``markov_w1``/``markov_w2`` ``[V, rank]``) and the
confidence head (``proj [1, D + rank]``). The embedding and head are the target's.
"""

from __future__ import annotations

import torch

from ..config import SLIDING, ModelConfig
from ..model.dspark import DSPARK_STAGES
from ..weights import block_shapes


def dspark_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every DSpark tensor of ``cfg`` (which must have ``cfg.dspark``)."""
    spec = cfg.dspark
    if spec is None:
        raise ValueError("dspark_shapes: the config has no DSpark fields (dspark_block_size, ...)")
    D, hc, V, r = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, spec.markov_rank
    shapes: dict[str, tuple[int, ...]] = {}
    for s in range(DSPARK_STAGES):
        shapes.update(
            {f"mtp.{s}.{n}": shape for n, shape in block_shapes(cfg, 0, SLIDING, hash_moe=False).items()}
        )
    last = f"mtp.{DSPARK_STAGES - 1}."
    shapes.update(
        {
            "mtp.0.main_proj.weight": (D, len(spec.target_layer_ids) * D),
            "mtp.0.main_norm.weight": (D,),
            last + "norm.weight": (D,),
            last + "hc_head_fn": (hc, hc * D),
            last + "hc_head_base": (hc,),
            last + "hc_head_scale": (1,),
            last + "markov_head.markov_w1.weight": (V, r),
            last + "markov_head.markov_w2.weight": (V, r),
            last + "confidence_head.proj.weight": (1, D + r),
        }
    )
    return shapes


def dspark_random_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Float32 random DSpark weights (official names) scaled like the tiny model's own."""
    from ..tiny import _init

    gen = torch.Generator().manual_seed(seed + 7919)
    return {name: _init(name, shape, gen, cfg) for name, shape in dspark_shapes(cfg).items()}
