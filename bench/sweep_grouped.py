"""Launch shapes of the grouped quantized experts (kernels/grouped_experts.py) at DeepSeek-V4-Flash's expert
shapes: a chunk's routed rows (top-6) sorted by expert, the gate-up launch (SwiGLU fused) and the down launch
timed apart, each replayed in a CUDA graph (``sweep_gemv.graph_seconds``: median of event-timed replays), for every candidate tile with the
operands in the first order and swapped (``GroupedTile.swap``). Weights are random bytes (timing only:
the kernels' work does not depend on the values).

On the GPU machine, from the repository root::

    PYTHONPATH=. python3 bench/sweep_grouped.py --out $OUT/grouped.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sweep_gemv import graph_seconds  # noqa: E402

from ds4serve.kernels import grouped_experts as ge  # noqa: E402
from ds4serve.quant import FP4Weight, FP8Weight  # noqa: E402

HIDDEN, INTER, TOP_K = 4096, 2048, 6
SHAPES = [
    (64, 64, 128, 4, 3),
    (64, 128, 128, 8, 3),
    (128, 64, 128, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (32, 64, 128, 4, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
]


def experts(fmt: str, E: int, N: int, K: int, g: torch.Generator) -> FP8Weight | FP4Weight:
    """Random experts ``[E, N, K]`` stored as ``fmt`` (FP8 with 128x128 blocks, or MXFP4)."""
    if fmt == "fp4":
        data = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device="cuda", generator=g).view(
            torch.int8
        )
        return FP4Weight(
            data, torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device="cuda", generator=g)
        )
    data = torch.randint(0, 0x7E, (E, N, K), dtype=torch.uint8, device="cuda", generator=g).view(
        torch.float8_e4m3fn
    )
    return FP8Weight(data, torch.rand(E, N // 128, K // 128, device="cuda", generator=g) * 1e-2, (128, 128))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--formats", default="fp8,fp4")
    p.add_argument("--shapes", default="256x2048,32x8192", help="EXPERTSxTOKENS, comma-separated")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            E, tokens = (int(v) for v in shape.split("x"))
            w1, w3, w2 = (
                experts(fmt, E, INTER, HIDDEN, g),
                experts(fmt, E, INTER, HIDDEN, g),
                experts(fmt, E, HIDDEN, INTER, g),
            )
            counts = torch.bincount(
                torch.randint(0, E, (tokens * TOP_K,), device="cuda", generator=g), minlength=E
            )
            ends = counts.cumsum(0).to(torch.int32)
            a = torch.randn(tokens * TOP_K, HIDDEN, device="cuda", generator=g).bfloat16()
            h = torch.randn(tokens * TOP_K, INTER, device="cuda", generator=g).bfloat16()
            flops = 2 * tokens * TOP_K * HIDDEN * INTER
            for swap in (False, True):
                for shape_args in SHAPES:
                    tile = ge.GroupedTile(*shape_args, swap=swap)
                    try:
                        up = (
                            graph_seconds([lambda: ge.grouped_quant_gate_up(a, w1, w3, ends, 10.0, tile)])
                            * 1e6
                        )
                        down = graph_seconds([lambda: ge.grouped_quant_mm(h, w2, ends, tile)]) * 1e6
                    except Exception as exc:  # a tile the compiler refuses (shared memory, shapes)
                        print(
                            f"{fmt} {shape} swap={swap} {tile}: {type(exc).__name__}: {str(exc)[:120]}",
                            flush=True,
                        )
                        continue
                    row = {
                        "fmt": fmt,
                        "experts": E,
                        "tokens": tokens,
                        "swap": swap,
                        "tile": dataclasses.asdict(tile),
                        "gate_up_us": up,
                        "down_us": down,
                        "gate_up_tflops": 2 * flops / up / 1e6,
                        "down_tflops": flops / down / 1e6,
                    }
                    results.append(row)
                    print(
                        f"{fmt} {E:3d} experts {tokens:5d} tokens swap={swap!s:5} rows {tile.rows:3d} cols "
                        f"{tile.cols:3d} inputs {tile.inputs:3d} warps {tile.warps} stages {tile.stages}: gate-up "
                        f"{up:8.1f} us ({row['gate_up_tflops']:5.0f} TFLOP/s), down {down:8.1f} us "
                        f"({row['down_tflops']:5.0f} TFLOP/s)",
                        flush=True,
                    )
                    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            E, tokens = (int(v) for v in shape.split("x"))
            rows = [r for r in results if (r["fmt"], r["experts"], r["tokens"]) == (fmt, E, tokens)]
            for key in ("gate_up_us", "down_us"):
                best = min(rows, key=lambda r: r[key], default=None)
                if best is not None:
                    print(f"best {fmt} {shape} {key}: {best[key]:.1f} us swap={best['swap']} {best['tile']}")


if __name__ == "__main__":
    main()
