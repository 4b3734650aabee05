"""Tile sweep of the batched step's expert tiles (:mod:`ds4serve.kernels.expert_tiles`) at DeepSeek-V4-Flash's
expert shapes (GPU only), beside the per-pair fused MoE (:mod:`ds4serve.kernels.moe`) the one-sequence step runs.

One layer call = R tokens, each through 6 routed experts of ``--experts`` plus the shared expert (D=4096,
inter=2048), in ``--format`` bf16, fp8 (128x128 blocks) or fp4 (MXFP4 routed experts, FP8 shared expert: the
proxy's fp8+fp4). Calls alternate between two copies of the layer's experts (far past the L2) with fresh routing;
a batch of calls is replayed as one CUDA graph and timed with CUDA events. A candidate is one tile for both
launches of the format; ``--spreads`` also times programs a routed expert gets (:func:`programs_per_expert`:
``pairs``, the shipped rule; ``rows``, one a tile of R; a number). Prints ms a call per (tile, spread, R) and the
best; tiles past the shared memory are skipped; ``--out`` writes them as JSON. ``--fma`` times the CUDA-core
tiles of :mod:`ds4serve.kernels.expert_fma` instead (which MXFP4 experts run in), ``--check`` also compares each
one's rows alone with a 128-row call, bitwise.

    PYTHONPATH=. python3 bench/sweep_expert_tiles.py --format fp4 --experts 256 --rows 1,64,128 --out $OUT/s.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from ds4serve.kernels import expert_tiles as et
from ds4serve.kernels.expert_fma import FmaConfig, expert_fma
from ds4serve.kernels.expert_tiles import ExpertTile, tensor_tiles
from ds4serve.kernels.moe import ExpertStack, Tile, moe_fused
from ds4serve.quant import FP4Weight, FP8Weight, Weight

K, D, INTER, LIMIT = 6, 4096, 2048, 10.0
FP8_BLOCK = (128, 128)
SHIPPED_SPREAD = et.programs_per_expert
CALLS = 20
CANDIDATES = [
    ExpertTile(cols, inputs, warps, stages)
    for cols, warps in ((32, 4), (64, 4), (128, 4), (128, 8))
    for inputs in (64, 128, 256)
    for stages in (3, 4)
]


def _matrix(fmt: str, *shape: int) -> Weight:
    """A random ``[..., out, in]`` expert matrix in ``fmt`` (scales of about 1 / sqrt(in))."""
    *lead, rows, cols = shape
    if fmt == "fp4":
        data = torch.randint(-128, 128, (*lead, rows, cols // 2), device="cuda", dtype=torch.int8)
        exp = 127 + round(math.log2(1 / (2.9 * math.sqrt(cols))))
        return FP4Weight(data, torch.full((*lead, rows, cols // 32), exp, dtype=torch.uint8, device="cuda"))
    dense = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    if fmt == "bf16":
        return dense / cols**0.5
    blocks = (*lead, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
    scale = torch.full(blocks, 2.0 ** round(math.log2(1 / (16 * math.sqrt(cols)))), device="cuda")
    return FP8Weight(dense.mul_(16).to(torch.float8_e4m3fn), scale, FP8_BLOCK)


def _layers(fmt: str, experts: int, copies: int) -> list[tuple[list[Weight], list[Weight]]]:
    shared_fmt = "fp8" if fmt == "fp4" else fmt

    def mats(f: str, *lead: int) -> list[Weight]:
        return [_matrix(f, *lead, o, i) for o, i in ((INTER, D), (INTER, D), (D, INTER))]

    return [(mats(fmt, experts), mats(shared_fmt)) for _ in range(copies)]


def _time(call, calls: int) -> float:
    """ms a call: ``calls`` calls captured in one graph, best of 5 replays."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def _routed(rows: int, experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` random tokens, each routed to K distinct experts with random weights: (x, idx, weights)."""
    x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:K] for _ in range(rows)])
    weights = torch.rand(rows, K, device="cuda", generator=gen).to(torch.bfloat16)
    return x, idx, weights


def _calls(rows: int, experts: int, layers, kernel: str | FmaConfig):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    inputs = [(*_routed(rows, experts, gen), layers[c % len(layers)]) for c in range(CALLS)]
    state = {"i": 0}

    def call() -> None:
        x, idx, weights, (routed, shared) = inputs[state["i"] % CALLS]
        state["i"] += 1
        if isinstance(kernel, FmaConfig):
            expert_fma(x, idx, weights, tuple(routed), tuple(shared), LIMIT, summed=False, config=kernel)
        elif kernel == "tiles":
            tensor_tiles(x, idx, weights, tuple(routed), tuple(shared), LIMIT, summed=False)
        else:
            stacks = [ExpertStack.of(m) for m in routed]
            moe_fused(
                x, idx, weights, *stacks, LIMIT, shared=tuple(ExpertStack.of(m) for m in shared), summed=False
            )

    return call


def _spread(name: str):
    if name == "pairs":
        return SHIPPED_SPREAD
    if name == "rows":
        return lambda R, k, E: -(-R // et.BLOCK_M)
    return lambda R, k, E: int(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8", "fp4"))
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--spreads", default="pairs")
    ap.add_argument(
        "--tiles", help="only these tiles, as cols x inputs x warps x stages: 128x128x4x3,64x64x4x3"
    )
    ap.add_argument(
        "--fma",
        help="CUDA-core tiles (ds4serve.kernels.expert_fma) to time instead of the tensor-core ones, as "
        "pairs:rows x block_k x warps (gate-up):rows x block_k x warps (down): 4:8x512x4:16x512x4,...",
    )
    ap.add_argument("--check", action="store_true", help="also check each --fma tile's rows bitwise alone")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    layers = _layers(args.format, args.experts, 2)
    rows = [int(r) for r in args.rows.split(",")]
    results = {"format": args.format, "experts": args.experts, "per_pair": {}, "tiles": []}
    for r in rows:
        results["per_pair"][r] = _time(_calls(r, args.experts, layers, "pairs"), CALLS)
        print(f"per-pair fused R={r}: {results['per_pair'][r]:.3f} ms", flush=True)
    if args.fma:
        _sweep_fma(args, layers, rows, results)
        return
    candidates = CANDIDATES
    if args.tiles:
        candidates = [ExpertTile(*(int(v) for v in t.split("x"))) for t in args.tiles.split(",")]
    for spread in args.spreads.split(","):
        et.programs_per_expert = _spread(spread)
        for tile in candidates:
            et.TILES[args.format] = (tile, tile)
            try:
                ms = {r: _time(_calls(r, args.experts, layers, "tiles"), CALLS) for r in rows}
            except OutOfResources as exc:
                print(tile, f"skipped: {exc}", flush=True)
                continue
            results["tiles"].append({"tile": tile.__dict__, "spread": spread, "ms": ms})
            print(tile, spread, " ".join(f"R={r}: {v:.3f}" for r, v in ms.items()), flush=True)
    for r in rows:
        best = min(results["tiles"], key=lambda t: t["ms"][r])
        print(f"best at R={r}: {best['tile']} {best['spread']} {best['ms'][r]:.3f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def _fma_config(text: str) -> FmaConfig:
    pairs, up, down = text.split(":")
    return FmaConfig(int(pairs), *(Tile(*(int(v) for v in t.split("x"))) for t in (up, down)))


def _sweep_fma(args, layers, rows: list[int], results: dict) -> None:
    """Time each ``--fma`` tile at every R (and with ``--check`` compare 3 rows alone against the batch)."""
    results["fma"] = []
    for text in args.fma.split(","):
        config = _fma_config(text)
        try:
            ms = {r: _time(_calls(r, args.experts, layers, config), CALLS) for r in rows}
        except OutOfResources as exc:
            print(text, f"skipped: {exc}", flush=True)
            continue
        entry = {"config": text, "ms": ms}
        if args.check:
            entry["alone_equal"] = _alone_equal(args.experts, layers, config)
        results["fma"].append(entry)
        print(
            "fma",
            text,
            " ".join(f"R={r}: {v:.3f}" for r, v in ms.items()),
            entry.get("alone_equal", ""),
            flush=True,
        )
    for r in rows:
        best = min(results["fma"], key=lambda t: t["ms"][r])
        print(f"best fma at R={r}: {best['config']} {best['ms'][r]:.3f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def _alone_equal(experts: int, layers, config: FmaConfig) -> bool:
    """Whether rows 0, 33 and 127 of a 128-row call give bitwise the same slot terms alone."""
    x, idx, weights = _routed(128, experts, torch.Generator(device="cuda").manual_seed(7))
    routed, shared = (tuple(m) for m in layers[0])
    full = expert_fma(x, idx, weights, routed, shared, LIMIT, summed=False, config=config)
    return all(
        torch.equal(
            expert_fma(
                x[r : r + 1],
                idx[r : r + 1],
                weights[r : r + 1],
                routed,
                shared,
                LIMIT,
                summed=False,
                config=config,
            )[0],
            full[r],
        )
        for r in (0, 33, 127)
    )


if __name__ == "__main__":
    main()
