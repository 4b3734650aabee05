"""Tile sweep of the batched step's expert tiles (:mod:`ds4serve.kernels.expert_tiles`) at the proxy's shapes
(GPU only), beside the per-pair fused MoE (:mod:`ds4serve.kernels.moe`) the one-sequence step runs.

One layer call = R tokens, each through 6 routed experts of 32 plus the shared expert (D=4096, inter=2048, bf16).
Calls alternate between two copies of the layer's experts (each 1.6 GB, far past the L2) with fresh routing;
a batch of calls is replayed as one CUDA graph and timed with CUDA events. A candidate is one tile for both
launches. Prints ms a call per (tile, R) and the best tile (tiles past the shared memory are skipped); ``--out`` writes them as JSON.

    PYTHONPATH=. python3 bench/sweep_expert_tiles.py --rows 1,16,64 --out $OUT/sweep_expert_tiles.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from ds4serve.kernels import expert_tiles as et
from ds4serve.kernels.expert_tiles import ExpertTile, expert_tiles
from ds4serve.kernels.moe import ExpertStack, moe_fused

E, K, D, INTER, LIMIT = 32, 6, 4096, 2048, 10.0
CALLS = 20
CANDIDATES = [
    ExpertTile(cols, inputs, warps, stages)
    for cols, warps in ((32, 4), (64, 4), (128, 4), (128, 8))
    for inputs in (64, 128, 256)
    for stages in (3, 4)
]


def _layers(copies: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    def mats(*lead: int) -> list[torch.Tensor]:
        return [
            torch.randn(*lead, o, i, device="cuda", dtype=torch.bfloat16) / i**0.5
            for o, i in ((INTER, D), (INTER, D), (D, INTER))
        ]

    return [(mats(E), mats()) for _ in range(copies)]


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


def _calls(rows: int, layers, kernel: str):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    inputs = []
    for c in range(CALLS):
        x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K] for _ in range(rows)])
        weights = torch.rand(rows, K, device="cuda", generator=gen).to(torch.bfloat16)
        inputs.append((x, idx, weights, layers[c % len(layers)]))
    state = {"i": 0}

    def call() -> None:
        x, idx, weights, (routed, shared) = inputs[state["i"] % CALLS]
        state["i"] += 1
        if kernel == "tiles":
            expert_tiles(x, idx, weights, tuple(routed), tuple(shared), LIMIT, summed=False)
        else:
            stacks = [ExpertStack(m) for m in routed]
            moe_fused(
                x, idx, weights, *stacks, LIMIT, shared=tuple(ExpertStack(m) for m in shared), summed=False
            )

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    layers = _layers(2)
    rows = [int(r) for r in args.rows.split(",")]
    results = {"per_pair": {}, "tiles": []}
    for r in rows:
        results["per_pair"][r] = _time(_calls(r, layers, "pairs"), CALLS)
        print(f"per-pair fused R={r}: {results['per_pair'][r]:.3f} ms", flush=True)
    for tile in CANDIDATES:
        et.TILES["bf16"] = (tile, tile)
        try:
            ms = {r: _time(_calls(r, layers, "tiles"), CALLS) for r in rows}
        except OutOfResources as exc:
            print(tile, f"skipped: {exc}", flush=True)
            continue
        results["tiles"].append({"tile": tile.__dict__, "ms": ms})
        print(tile, " ".join(f"R={r}: {v:.3f}" for r, v in ms.items()), flush=True)
    for r in rows:
        best = min(results["tiles"], key=lambda t: t["ms"][r])
        print(f"best at R={r}: {best['tile']} {best['ms'][r]:.3f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
