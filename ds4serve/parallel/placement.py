"""Which contiguous layer range each device owns.

A split is a list of layer counts, one per device, in pipeline order: ``[22, 21]`` gives layers
0-21 to the first device and 22-42 to the second. The first shard also holds the embedding and
the last one the final merge, norm and output head. Without an explicit split, layers are cut so
that each device's share of the weight bytes is proportional to the memory it has free after
room is left for sequence state and activations.

Byte counts follow what :meth:`DeepSeekV4.load <ds4serve.model.DeepSeekV4.load>` keeps in memory:
projection matrices in the model dtype, norms, mHC mixers, compressor position biases, attention
sinks and router biases in float32, hash-routing tables as int64. A quantized load keeps the layers'
FP8 matrices as one byte a weight plus a float32 scale per block, and MXFP4 experts as half a byte a
weight plus a one-byte exponent per 32 (``formats``: :func:`quantized_formats` of the checkpoint).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Mapping

import torch

from ..config import CSA, SLIDING, ModelConfig
from ..quant import FP4_BLOCK
from ..weights import Checkpoint, block_shapes, expected_shapes

log = logging.getLogger("ds4serve.parallel")

HEAD_NAMES = ("head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")
DEFAULT_ACTIVATION_RESERVE = 2 * 1024**3  # per device: chunk activations, logits, allocator slack


Formats = Mapping[str, str]  # tensor name -> "fp8" | "fp4": kept quantized by the load
FP8_BLOCK = (128, 128)  # FP8 scale block when the config names none


def quantized_formats(ckpt: Checkpoint) -> dict[str, str]:
    """The layer tensors that a quantized load of ``ckpt`` keeps quantized, and how."""
    out = {}
    for name in expected_shapes(ckpt.cfg):
        if name.startswith("layers.") and (fmt := ckpt.storage_format(name)) is not None:
            out[name] = fmt
    return out


def tensor_bytes(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    fmt: str | None = None,
    fp8_block: tuple[int, int] = FP8_BLOCK,
) -> int:
    """Bytes of one tensor as the model loads it (see the module doc for the dtype rules); ``fmt`` is
    its quantized format when the load keeps it quantized."""
    numel = 1
    for d in shape:
        numel *= d
    if fmt == "fp8":
        return numel + 4 * -(-shape[-2] // fp8_block[0]) * -(-shape[-1] // fp8_block[1])
    if fmt == "fp4":
        return numel // 2 + numel // FP4_BLOCK
    if name.endswith("tid2eid"):
        return numel * 8
    if len(shape) == 2 and name.endswith(".weight"):
        return numel * torch.empty((), dtype=dtype).element_size()
    return numel * 4


def layer_weight_bytes(cfg: ModelConfig, dtype: torch.dtype, formats: Formats | None = None) -> list[int]:
    """Weight bytes of each decoder layer, in layer order (embedding and head excluded)."""
    formats = formats or {}
    block = cfg.quant.fp8_block or FP8_BLOCK
    return [
        sum(
            tensor_bytes(n, s, dtype, formats.get(f"layers.{i}.{n}"), block)
            for n, s in block_shapes(cfg, i).items()
        )
        for i in range(cfg.num_layers)
    ]


def embed_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return tensor_bytes("embed.weight", expected_shapes(cfg)["embed.weight"], dtype)


def head_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    shapes = expected_shapes(cfg)
    return sum(tensor_bytes(n, shapes[n], dtype) for n in HEAD_NAMES)


def layer_state_bytes(cfg: ModelConfig, layer: int, max_context: int, dtype: torch.dtype) -> int:
    """Bytes of one layer's sequence state for ``max_context`` tokens (mirrors ``allocate_layer``)."""
    size = torch.empty((), dtype=dtype).element_size()
    total = cfg.sliding_window * cfg.head_dim * size
    kind = cfg.layer_types[layer]
    if kind == SLIDING:
        return total
    rate = cfg.csa_rate if kind == CSA else cfg.hca_rate
    dims = [(cfg.head_dim, kind == CSA)] + ([(cfg.index_head_dim, True)] if kind == CSA else [])
    for dim, overlap in dims:
        width = 2 * dim if overlap else dim
        total += rate * width * (size + 4)  # raw kv rows + float32 gate rows of the open window
        if overlap:
            total += rate * dim * (size + 4)  # first half of the last closed window
        total += (max_context // rate + 1) * dim * size  # compressed entries (+ a spare row)
    return total


def shard_weight_bytes(
    cfg: ModelConfig, layers: range, dtype: torch.dtype, formats: Formats | None = None
) -> int:
    """Weights of a layer range, with the embedding and the head where the range holds them."""
    per_layer = layer_weight_bytes(cfg, dtype, formats)
    total = sum(per_layer[i] for i in layers)
    if layers.start == 0:
        total += embed_bytes(cfg, dtype)
    if layers.stop == cfg.num_layers:
        total += head_bytes(cfg, dtype)
    return total


def shard_state_bytes(cfg: ModelConfig, layers: range, max_context: int, dtype: torch.dtype) -> int:
    return sum(layer_state_bytes(cfg, i, max_context, dtype) for i in layers)


def shard_bytes(
    cfg: ModelConfig, layers: range, dtype: torch.dtype, max_context: int = 0, formats: Formats | None = None
) -> int:
    """Weights plus the sequence state of ``max_context`` tokens of a layer range."""
    return shard_weight_bytes(cfg, layers, dtype, formats) + shard_state_bytes(
        cfg, layers, max_context, dtype
    )


def ranges_from_split(layer_split: list[int], num_layers: int, n_devices: int) -> list[range]:
    """Validate ``layer_split`` (layer counts per device) and turn it into layer ranges."""
    if len(layer_split) != n_devices:
        raise ValueError(
            f"layer_split: expected {n_devices} counts (one per device), got {len(layer_split)}: "
            f"{list(layer_split)}"
        )
    if any(not isinstance(n, int) or n < 1 for n in layer_split):
        raise ValueError(f"layer_split: every device needs at least one layer, got {list(layer_split)}")
    if sum(layer_split) != num_layers:
        raise ValueError(
            f"layer_split: counts must sum to the model's {num_layers} layers, "
            f"got {list(layer_split)} (sum {sum(layer_split)})"
        )
    ranges, start = [], 0
    for n in layer_split:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def free_memory(devices: list[torch.device]) -> list[int]:
    """Free bytes for each device, shared equally among entries naming the same device."""
    uses = Counter(str(d) for d in devices)
    out = []
    for d in devices:
        if d.type == "cuda":
            free = torch.cuda.mem_get_info(d)[0]
        elif d.type == "cpu":
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        else:
            raise ValueError(f"devices: cannot measure free memory of {d}; pass layer_split explicitly")
        out.append(free // uses[str(d)])
    return out


def plan_split(
    cfg: ModelConfig,
    devices: list[torch.device | str],
    dtype: torch.dtype,
    *,
    max_context: int,
    layer_split: list[int] | None = None,
    free_bytes: list[int] | None = None,
    reserve: int | None = None,
    formats: Formats | None = None,
) -> list[range]:
    """The layer range of each device, explicit (``layer_split``) or balanced by free memory.

    The automatic split cuts the layers so that each device's share of the bytes (weights and
    ``max_context`` tokens of state) follows its capacity: free memory minus ``reserve`` (default:
    2 GiB, or a tenth of the free memory when that is less); ``formats`` counts the tensors a
    quantized load keeps quantized at their quantized size. Every
    shard is checked against its device's capacity either way; a split that cannot fit is an error
    naming the device and the bytes it would need.
    """
    devs = [torch.device(d) for d in devices]
    n = cfg.num_layers
    if not devs:
        raise ValueError("devices: expected at least one device")
    if len(devs) > n:
        raise ValueError(
            f"devices: {len(devs)} devices but the model has only {n} layers (one per device at most)"
        )
    if layer_split is not None:
        ranges = ranges_from_split(list(layer_split), n, len(devs))
        if free_bytes is None:
            return ranges
    free = free_bytes if free_bytes is not None else free_memory(devs)
    if len(free) != len(devs):
        raise ValueError(f"free_bytes: expected {len(devs)} values (one per device), got {len(free)}")
    reserves = [reserve if reserve is not None else min(DEFAULT_ACTIVATION_RESERVE, f // 10) for f in free]
    capacity = [max(f - r, 0) for f, r in zip(free, reserves)]
    if layer_split is None:
        ranges = _balanced(cfg, dtype, max_context, capacity, formats)
    for dev, r, cap, res in zip(devs, ranges, capacity, reserves):
        need = shard_bytes(cfg, r, dtype, max_context, formats)
        if need > cap:
            raise ValueError(
                f"devices: layers {r.start}-{r.stop - 1} need {_size(need)} on {dev} but "
                f"only {_size(cap)} is free after a {_size(res)} reserve; "
                f"add devices, lower max_context or choose layer_split"
            )
    return ranges


def _balanced(
    cfg: ModelConfig, dtype: torch.dtype, max_context: int, capacity: list[int], formats: Formats | None
) -> list[range]:
    """Cut points nearest to each device's capacity-proportional share of the total bytes."""
    n, k = cfg.num_layers, len(capacity)
    if sum(capacity) == 0:
        raise ValueError("devices: no free memory left on any device after the activation reserve")
    per_layer = [
        w + layer_state_bytes(cfg, i, max_context, dtype)
        for i, w in enumerate(layer_weight_bytes(cfg, dtype, formats))
    ]
    per_layer[0] += embed_bytes(cfg, dtype)
    per_layer[-1] += head_bytes(cfg, dtype)
    total = sum(per_layer)
    prefix = [0]
    for b in per_layer:
        prefix.append(prefix[-1] + b)
    cuts, share = [0], 0
    for d in range(k - 1):
        share += capacity[d]
        target = total * share / sum(capacity)
        lo, hi = cuts[-1] + 1, n - (k - 1 - d)  # leave at least one layer for every later device
        cut = min(range(lo, hi + 1), key=lambda c: abs(prefix[c] - target))
        cuts.append(cut)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def describe(
    cfg: ModelConfig,
    devices: list[torch.device | str],
    ranges: list[range],
    dtype: torch.dtype,
    max_context: int,
    formats: Formats | None = None,
) -> str:
    """One line per shard: device, layers and bytes; logged when a split is chosen."""
    lines = []
    for dev, r in zip(devices, ranges):
        lines.append(
            f"{dev}: layers {r.start}-{r.stop - 1} ({len(r)}), "
            f"{_size(shard_bytes(cfg, r, dtype, max_context, formats))} weights + state"
        )
    return "; ".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
