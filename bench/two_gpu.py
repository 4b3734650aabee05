"""The full-size DeepSeek-V4-Flash shape (43 layers, 256 routed experts) split over two GPUs in one
process (:class:`~ds4serve.parallel.SplitModel`), random FP8 weights with MXFP4 routed experts made
directly on each GPU; decode and prefill timings, the boundary hand-off, memory per GPU, and greedy
tokens of the split against the same shards run on one placement order twice (determinism).

Run on a machine with two GPUs: ``PYTHONPATH=. python3 bench/two_gpu.py --out two_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from ds4serve.model import DeepSeekV4
from ds4serve.model.deepseek4 import HeadWeights
from ds4serve.parallel.split_model import SplitModel, handoff

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import ceilings, cuda_ms, decode_ms, eager_step, log, prefill  # noqa: E402
from proxy import _Maker, bytes_per_token, flash_config  # noqa: E402


def build_shards(variant: str, experts: int, split: int) -> SplitModel:
    """Layers ``0..split-1`` on cuda:0, the rest on cuda:1, each made on its own device."""
    cfg = flash_config(43, experts, variant)
    D, hc = cfg.hidden_size, cfg.hc_mult
    shards = []
    for k, layers in enumerate((range(0, split), range(split, cfg.num_layers))):
        dev = torch.device(f"cuda:{k}")
        mk = _Maker(cfg, variant, dev, seed=k)
        blocks = {i: mk.block(i) for i in layers}
        embed = mk.randn(cfg.vocab_size, D) if k == 0 else None
        head = None
        if k == 1:
            head = HeadWeights(hc_fn=mk.f32(hc, hc * D, std=0.5 / math.sqrt(hc * D)), hc_base=mk.f32(hc),
                               hc_scale=mk.f32(1, mean=1.0), norm=mk.f32(D, mean=1.0),
                               head=mk.dense(cfg.vocab_size, D))
        shards.append(DeepSeekV4(cfg, layers, blocks, embed, head, torch.bfloat16, dev))
        torch.cuda.synchronize(dev)
        log(f"shard {k}: layers {layers.start}..{layers.stop - 1} on {dev}, "
            f"{torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB allocated")
    return SplitModel(shards)


def shard_bytes_per_token(model: SplitModel) -> int:
    """:func:`proxy.bytes_per_token` summed over the shards (embedding row and head counted once)."""
    total = 0
    for s in model.shards:
        probe = DeepSeekV4(s.cfg, s.layers, s.blocks, s.embed if s.embed is not None else model.shards[0].embed,
                           s.head if s.head is not None else model.shards[-1].head, s.dtype, s.device)
        part = bytes_per_token(probe)
        if s.head is None:  # bytes_per_token adds the head and one embedding row: count them on one shard
            part -= sum(t.numel() * t.element_size() for t in (probe.head.hc_fn, probe.head.hc_base,
                                                                probe.head.hc_scale, probe.head.norm,
                                                                probe.head.head))
            part -= s.cfg.hidden_size * probe.embed.element_size()
        total += part
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", default="fp8+fp4")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--split", type=int, default=22)
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("two_gpu.py needs two GPUs")
    out: dict = {"gpus": [torch.cuda.get_device_name(i) for i in range(2)], "variant": args.variant,
                 "experts": args.experts, "split": args.split}
    out["copy_GBps"] = []
    for i in range(2):
        with torch.cuda.device(i):
            out["copy_GBps"].append(ceilings()["copy_GBps"])
    model = build_shards(args.variant, args.experts, args.split)
    out["memory_GiB"] = [torch.cuda.memory_allocated(i) / 2**30 for i in range(2)]
    out["bytes_per_token_GB"] = shard_bytes_per_token(model) / 1e9
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, model.cfg.hc_mult, model.cfg.hidden_size, dtype=torch.bfloat16, device="cuda:0")
    out["handoff_ms"] = cuda_ms(lambda: handoff(hidden, torch.device("cuda:1")), 20)
    with torch.inference_mode():
        for ctx in (int(c) for c in args.contexts.split(",")):
            ids = torch.randint(3, 128000, (ctx,), generator=gen).tolist()
            state = model.new_state(ctx + 2 * args.steps + 8)
            t0 = time.perf_counter()
            prefill(model, state, ids, 2048)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            prefill_s = time.perf_counter() - t0
            snap = state.snapshot()
            ms, tokens = decode_ms(eager_step(model), state, args.steps, ids[-1])
            state.restore(snap)
            _, again = decode_ms(eager_step(model), state, args.steps, ids[-1])
            row = {"prefill_s": prefill_s, "prefill_tokens_per_s": ctx / prefill_s, "eager_decode_ms": ms,
                   "tokens": tokens, "same_tokens_after_restore": tokens == again,
                   "GBps": out["bytes_per_token_GB"] / ms * 1e3,
                   "fraction_of_two_gpus_copy": out["bytes_per_token_GB"] / ms * 1e3 / sum(out["copy_GBps"])}
            out[f"ctx_{ctx}"] = row
            log(f"ctx {ctx}: prefill {row['prefill_tokens_per_s']:.0f} tok/s, eager decode {ms:.1f} ms/token, "
                f"same tokens after restore {row['same_tokens_after_restore']}")
            del state, snap
    out["memory_peak_GiB"] = [torch.cuda.max_memory_allocated(i) / 2**30 for i in range(2)]
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not k.startswith("ctx_")}, indent=2))


if __name__ == "__main__":
    main()
