"""Tile sweep of a prefill chunk's mHC mixes (``hc_streams.hc_mixes``) against the torch code (GPU only).

The torch code of a chunk site, compiled as in a chunk forward (``hyper._hc_mixes``: the fp32 norm, then
cuBLAS's fp32 GEMM with ``fn``), and the kernel at each candidate ``MixTile``, on the proxy's streams
(``[S, 4, 4096]`` bf16, ``fn [24, 16384]``) for S in ``--tokens``. Each candidate is checked against the
torch code first; the time is the median of CUDA-event timings over several calls. Usage::

    PYTHONPATH=. python3 bench/sweep_mixes.py [--tokens 2048,8192] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import cuda_ms  # noqa: E402

from ds4serve.kernels.hc_streams import MixTile, hc_mixes  # noqa: E402
from ds4serve.model import hyper  # noqa: E402

HC, D, MIX = 4, 4096, 24
TILES = [
    MixTile(r, 128, parts, w, s)
    for r, parts, w, s in itertools.product((32, 64, 128), (4, 8, 16), (4, 8), (3,))
    if not (r == 128 and w == 4)
]


def cuda_us(fn) -> float:
    return cuda_ms(fn, 20, warmup=1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(MIX, HC * D, generator=g, device="cuda") * 0.5 / (HC * D) ** 0.5
    rows = []
    for S in (int(t) for t in args.tokens.split(",")):
        X = torch.randn(S, HC, D, generator=g, device="cuda").bfloat16()
        with torch.inference_mode():
            want = hyper._hc_mixes(X, fn, 1e-6)
            torch_us = cuda_us(lambda: hyper._hc_mixes(X, fn, 1e-6))
        print(f"S={S}: torch code {torch_us:7.1f} us", flush=True)
        results = []
        for tile in TILES:
            try:
                got = hc_mixes(X, fn, 1e-6, tile)
            except Exception as e:  # a tile the compiler refuses (shared memory, registers)
                print(f"  {tile}: {type(e).__name__}", flush=True)
                continue
            err = float((got - want).abs().max() / want.abs().max())
            if err > 1e-4:
                print(f"  {tile}: wrong, max rel {err:.1e}", flush=True)
                continue
            us = cuda_us(lambda: hc_mixes(X, fn, 1e-6, tile))
            results.append((us, tile))
            rows.append({"tokens": S, "tile": tile.__dict__, "us": us, "torch_us": torch_us, "max_rel": err})
        results.sort(key=lambda r: r[0])
        for us, tile in results[:8]:
            print(f"  {us:7.1f} us  {tile}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    sys.exit(0 if rows else 1)


if __name__ == "__main__":
    main()
