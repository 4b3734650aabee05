"""Projections that read the same input, stored as few concatenated weights.

A CSA layer projects its normalised input seven times (``wq_a``, ``wkv``, both compressors' kv and
gate, the indexer's head weights) and ``q_res`` twice. In a batch-1 decode step each product is a
GEMV of a few megabytes: separately they are seven launches that each reach a fraction of the
memory bandwidth. :func:`concatenate` stores the parts of one storage format as one weight (the
parts become row views of it, so nothing is held twice) and :class:`Projections` runs one product
per format and splits the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import FP8Weight, Weight
from .linear import linear, linear_pair


@dataclass(frozen=True)
class _Group:
    weight: Weight
    names: tuple[str, ...]
    sizes: tuple[int, ...]


class Projections:
    """``x @ w.T`` for several named weights ``w`` of the same input width, one product per group.

    Not a dataclass on purpose: model byte counts walk dataclass fields, and the parts (row views
    of the groups' weights) are already counted there.
    """

    def __init__(self, groups: list[_Group]):
        self.groups = groups

    @classmethod
    def separate(cls, parts: dict[str, Weight]) -> "Projections":
        """One product per part (weights not concatenated)."""
        return cls([_Group(w, (name,), (w.shape[0],)) for name, w in parts.items()])

    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.named(self.products(x))

    def products(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One product per group, unsplit: ``[..., sum of the group's sizes]``."""
        if len(self.groups) == 2:  # e.g. a layer's FP8 inputs and its bf16 compressors: maybe one launch
            return linear_pair(x, self.groups[0].weight, self.groups[1].weight)
        return tuple(linear(x, g.weight) for g in self.groups)

    def named(self, ys: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """The products ``ys`` (of :meth:`products`, or rows of them) split into the parts, by name."""
        out: dict[str, torch.Tensor] = {}
        for g, y in zip(self.groups, ys):
            out.update(zip(g.names, y.split(g.sizes, dim=-1) if len(g.names) > 1 else (y,)))
        return out


def _format_key(w: Weight) -> tuple | None:
    """Parts with equal keys can share one weight; None: this part stays on its own."""
    if isinstance(w, torch.Tensor):
        return ("dense", w.dtype, w.shape[1], w.device) if w.dim() == 2 and w.is_contiguous() else None
    if isinstance(w, FP8Weight) and w.data.dim() == 2 and w.shape[0] % w.block[0] == 0:
        return ("fp8", w.block, w.shape[1], w.data.device)
    return None


def concatenate(parts: dict[str, Weight]) -> tuple[Projections, dict[str, Weight]]:
    """Group ``parts`` by storage format, concatenate each group's rows, and return the projections
    and every part as a view of its group's weight (the originals can then be dropped)."""
    by_key: dict[tuple, list[str]] = {}
    alone: list[str] = []
    for name, w in parts.items():
        key = _format_key(w)
        (by_key.setdefault(key, []) if key is not None else alone).append(name)
    groups, views = [], {}
    for names in [*by_key.values(), *([n] for n in alone)]:
        ws = [parts[n] for n in names]
        sizes = tuple(w.shape[0] for w in ws)
        fused = ws[0] if len(ws) == 1 else _cat(ws)
        groups.append(_Group(fused, tuple(names), sizes))
        start = 0
        for name, size in zip(names, sizes):
            views[name] = fused if len(ws) == 1 else _rows(fused, start, size)
            start += size
    return Projections(groups), views


def _cat(ws: list[Weight]) -> Weight:
    if isinstance(ws[0], FP8Weight):  # concatenated as bytes: not every device's cat takes float8
        data = torch.cat([w.data.view(torch.uint8) for w in ws]).view(ws[0].data.dtype)
        return FP8Weight(data, torch.cat([w.scale for w in ws]), ws[0].block)
    return torch.cat(ws)


def _rows(w: Weight, start: int, size: int) -> Weight:
    if isinstance(w, FP8Weight):
        b = w.block[0]
        return FP8Weight(w.data[start : start + size], w.scale[start // b : (start + size) // b], w.block)
    return w[start : start + size]
