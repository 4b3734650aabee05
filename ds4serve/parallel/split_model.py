"""A model split into contiguous layer ranges, one :class:`DeepSeekV4` per device, in one process.

Each shard runs the one forward path (:meth:`DeepSeekV4.forward`; for a batched decode step
:meth:`DeepSeekV4.decode_batch`) over its own layers; the hidden
streams ``[S, hc, D]`` leaving a shard are copied into a fresh tensor on the next shard's device, so no shard
ever reads a buffer another shard writes. One
:class:`SequenceState` holds every layer's state on its own shard's device, so commit, snapshot, restore and
fork cover all shards.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from ..devices import on_device
from ..model import DeepSeekV4
from ..model.batch import BatchForward
from ..model.deepseek4 import ForwardResult
from ..state import ChunkDelta, SequenceState, allocate_layer
from ..weights import Checkpoint
from .placement import describe, plan_split, quantized_formats

log = logging.getLogger("ds4serve.parallel")


class SplitModel:
    """Shards of one model, run in layer order; the engine uses it like a :class:`DeepSeekV4`."""

    def __init__(self, shards: list[DeepSeekV4]):
        if not shards:
            raise ValueError("shards: expected at least one shard")
        cfg = shards[0].cfg
        expected = 0
        for s in shards:
            if s.layers.start != expected:
                raise ValueError(
                    f"shards: layer ranges must be contiguous from 0, got "
                    f"{[(x.layers.start, x.layers.stop) for x in shards]}"
                )
            expected = s.layers.stop
        if expected != cfg.num_layers:
            raise ValueError(f"shards: layer ranges end at {expected}, the model has {cfg.num_layers} layers")
        self.shards = shards
        self.cfg: ModelConfig = cfg
        self.layers = range(0, cfg.num_layers)
        self.dtype = shards[0].dtype
        self.device = shards[-1].device  # where the logits land

    @classmethod
    def load(
        cls,
        ckpt: Checkpoint,
        ranges: list[range],
        devices: list[torch.device | str],
        dtype: torch.dtype = torch.float32,
        quantized: bool = False,
    ) -> "SplitModel":
        if len(ranges) != len(devices):
            raise ValueError(
                f"devices: expected {len(ranges)} devices for {len(ranges)} layer ranges, got {len(devices)}"
            )
        return cls(
            [
                DeepSeekV4.load(ckpt, layers=r, dtype=dtype, device=d, quantized=quantized)
                for r, d in zip(ranges, devices)
            ]
        )

    @property
    def devices(self) -> list[torch.device]:
        return [s.device for s in self.shards]

    def new_state(self, max_context: int) -> SequenceState:
        layers = {
            i: allocate_layer(self.cfg, self.cfg.layer_types[i], max_context, s.dtype, s.device)
            for s in self.shards
            for i in s.layers
        }
        return SequenceState(layers=layers, max_context=max_context, window=self.cfg.sliding_window)

    def forward(
        self,
        token_ids: list[int] | torch.Tensor,
        state: SequenceState,
        *,
        hidden: torch.Tensor | None = None,
        logit_rows: torch.Tensor | slice | None = None,
        capture: tuple[int, ...] = (),
    ) -> ForwardResult:
        """Run every shard in order over the chunk; the result is the unsplit model's."""
        layers, captured = {}, {}
        result = None
        for k, shard in enumerate(self.shards):
            last = k == len(self.shards) - 1
            with on_device(shard.device):  # Triton launches on the current device, not the tensors'
                result = shard.forward(
                    token_ids, state, hidden=hidden, logit_rows=logit_rows if last else None, capture=capture
                )
            layers.update(result.delta.layers)
            captured.update(result.captured)
            if not last:
                hidden = handoff(result.hidden, self.shards[k + 1].device)
        delta = ChunkDelta(start=result.delta.start, tokens=result.delta.tokens, layers=layers)
        return ForwardResult(hidden=result.hidden, delta=delta, logits=result.logits, captured=captured)

    def decode_batch(self, token_ids: list[int], states: list[SequenceState]) -> BatchForward:
        """One new token for each of N sequences through every shard in order (each shard's
        :meth:`DeepSeekV4.decode_batch` over its layers); the result is the unsplit model's. Writes nothing."""
        layers: list[dict] = [{} for _ in states]
        hidden = out = None
        for k, shard in enumerate(self.shards):
            with on_device(shard.device):
                out = shard.decode_batch(token_ids, states, hidden=hidden)
            for merged, delta in zip(layers, out.deltas):
                merged.update(delta.layers)
            if k < len(self.shards) - 1:
                hidden = handoff(out.hidden, self.shards[k + 1].device)
        deltas = [ChunkDelta(start=d.start, tokens=d.tokens, layers=m) for d, m in zip(out.deltas, layers)]
        return BatchForward(logits=out.logits, deltas=deltas, hidden=out.hidden)

    def tensors(self) -> list[torch.Tensor]:
        return [t for s in self.shards for t in s.tensors()]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.shards)


def handoff(hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The streams leaving one shard as a new tensor on the next shard's device (never an alias)."""
    return hidden.to(device=device, copy=True)


def split_loader(
    path: str | Path,
    devices: list[str | torch.device],
    dtype: torch.dtype,
    *,
    layer_split: list[int] | None = None,
    max_context: int | None = None,
    quantized: bool = False,
) -> Callable[[], SplitModel]:
    """Choose the layer ranges once (logged) and return a loader that builds the split model.

    The ranges are fixed here so that reloading after a park gives the same placement whatever
    memory is free at that moment.
    """
    cfg = ModelConfig.from_dir(path)
    context = max_context or cfg.max_position_embeddings
    formats = quantized_formats(Checkpoint(path)) if quantized else None
    ranges = plan_split(cfg, devices, dtype, max_context=context, layer_split=layer_split, formats=formats)
    log.info("layer split: %s", describe(cfg, devices, ranges, dtype, context, formats))
    return lambda: SplitModel.load(Checkpoint(path), ranges, devices, dtype, quantized=quantized)
