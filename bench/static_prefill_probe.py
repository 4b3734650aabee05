"""Probe: a prompt chunk run as a captured static block (the verify graph's forward) against the chunk forward.

Prefill chunks of up to 2048 tokens are bound by the host's launches (bench/RESULTS.md, fifteenth run). The
static forward (``positions=``) of a block of W tokens has no host synchronisation and can be captured
as a CUDA graph (:class:`ds4serve.engine.cuda_graphs.VerifyGraph`); a prompt of n <= W tokens would run
padded to W, its first n rows committed. For the 43-layer bf16 proxy at a few block widths and state
capacities, this times the chunk forward at position 0, the capture (compiles included) and the replay,
and compares the last real row's logits and the greedy tokens of every real row.

    PYTHONPATH=. python3 bench/static_prefill_probe.py [--widths 512,2048] [--capacities 8192,65536] \
        [--switches defaults-block_regions]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import cuda_ms, log  # noqa: E402
from proxy import build_proxy  # noqa: E402

from ds4serve.engine.cuda_graphs import VerifyGraph  # noqa: E402
from ds4serve.kernels.switches import parse, using  # noqa: E402


def probe(model, cap: int, width: int, n: int, gen: torch.Generator) -> None:
    """One width over a state of ``cap`` positions: ``n`` real tokens, chunk forward against static graph."""
    state = model.new_state(cap)
    ids = torch.randint(3, 128000, (n,), generator=gen).tolist()

    def chunk() -> torch.Tensor:
        state.reset()
        return model.forward(ids, state, logit_rows=slice(None)).logits

    ref = chunk()
    chunk_ms = cuda_ms(chunk, 3, warmup=1)
    state.reset()
    t0 = time.perf_counter()
    try:
        graph = VerifyGraph(model, state, width)
    except Exception as exc:  # noqa: BLE001 - a failed capture is a result
        log(f"cap {cap} width {width}: capture failed: {type(exc).__name__}: {str(exc)[-1500:]}")
        return
    capture_s = time.perf_counter() - t0
    block = ids + [0] * (width - n)
    logits = graph.replay(block, 0).logits[:n].float()
    rel = float((logits[-1] - ref[-1].float()).abs().max() / ref[-1].float().abs().max())
    same = float((logits.argmax(-1) == ref.float().argmax(-1)).float().mean())
    replay_ms = cuda_ms(partial(graph.replay, block, 0), 5, warmup=1)
    log(f"cap {cap} width {width} ({n} real tokens): chunk forward {chunk_ms:.1f} ms ({n / chunk_ms * 1e3:.0f} "
        f"tok/s), static graph {replay_ms:.1f} ms ({n / replay_ms * 1e3:.0f} tok/s), capture {capture_s:.0f} s; "
        f"last row rel {rel:.2e}, greedy rows equal {100 * same:.1f}%")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", default="512,2048")
    p.add_argument("--capacities", default="8192")
    p.add_argument("--fill", type=float, default=0.8, help="real tokens as a fraction of the width")
    p.add_argument("--layers", type=int, default=43)
    p.add_argument("--switches", default="defaults", help="the switch set of the static graphs (switches.parse)")
    args = p.parse_args()
    model = build_proxy("bf16", layers=args.layers)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for cap in (int(c) for c in args.capacities.split(",")):
            for width in (int(w) for w in args.widths.split(",")):
                with using(**parse(args.switches)):
                    probe(model, cap, width, max(1, int(width * args.fill)), gen)
                gc.collect()
                torch.cuda.empty_cache()
    log(f"peak memory {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB")


if __name__ == "__main__":
    main()
